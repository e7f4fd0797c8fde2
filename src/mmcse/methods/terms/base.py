"""What a loss term is: one object that owns its name, its switch, its weight's parameter, the parameters its
function reads, the batch embeddings it reads, and where it runs. The declaration is data, importable without
torch (a plan, a job's identity and the parameter check read it in a fraction of a second); the function that
computes the term is registered under its name by :mod:`mmcse.methods.compute`, and the paper equations stay
pure functions of tensors in :mod:`mmcse.methods.losses`.

Every module of :mod:`mmcse.methods.terms` registers its terms with :func:`register`; the package
imports each module it holds. What a configuration trains (`mmcse.methods.objectives.active_terms`), which
cached features a batch loads (`needed_features`), which student outputs a step computes (`needed_inputs`),
which ``loss`` parameters a job's identity keeps (`objective_keys`) and the step's weighted sum
(`mmcse.methods.step.step_objective`) are all derived from the registered terms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcse.config import Config, LossConfig

if TYPE_CHECKING:  # the tensors a step carries; a declaration never makes one
    import torch

STAT = "stat/"  # prefix of diagnostics in a step's dict: logged, never added to the loss

# The fields of `StepEmbeddings` a term may read, and the cached feature group each one comes from
# (None: the student makes it from the batch's tokens alone).
INPUT_FEATURES: dict[str, str | None] = {
    "z": None,  # z1, z2: the SimCSE space on both dropout views
    "s": None,  # s1, s2: g_φ1 on [CLS]
    "image": "image",
    "teacher_text": "joint",
    "teacher_image": "joint",
    "joint_text": "joint",
    "joint_image": "joint",
    "shared_text": None,
    "shared_image": "joint",
    "text_teacher_sim": "text_teachers",
    "rank_teacher_sim": "text_teachers",
    "text_teacher": "text_teachers",
    "phrases": "objects",
    "objects": "objects",
    "object_pair": "objects",
    "mlm": None,  # mlm_logits, mlm_labels: the LM head on a masked copy of both views
}
# The loss parameters the training step reads to make an input (`mmcse.training.loop.training_step_loss`),
# beside those the terms read themselves: part of what a configuration trains with (`objective_keys`).
INPUT_SETTINGS: dict[str, tuple[str, ...]] = {
    "mlm": ("loss.simcse.mlm_probability", "loss.simcse.mlm_head"),
    "text_teacher_sim": ("loss.dalr.teacher_weighting",),
    "rank_teacher_sim": ("loss.dalr.rank_teacher_weighting",),
    "text_teacher": ("loss.dalr.teacher_weighting",),
    "shared_text": ("loss.dalr.consistency_text",),
}


@dataclass
class StepEmbeddings:
    """One batch of N sentences: student outputs and cached teacher features.

    Only the fields the active terms read (`needed_inputs`) are set.
    """

    z1: torch.Tensor  # (N, H) SimCSE space, dropout view z
    z2: torch.Tensor  # (N, H) dropout view z'
    pair_batch: bool = False
    s1: torch.Tensor | None = None  # (N, p) g_φ1/g_φg on [CLS], view z
    s2: torch.Tensor | None = None  # (N, p) view z'
    image: torch.Tensor | None = None  # (N, p) g_φ2 of the image-encoder features (MCSE, MCSEO)
    teacher_text: torch.Tensor | None = None  # (N, p) g_φt(t̂) (KDMCSE Eq. 5)
    teacher_image: torch.Tensor | None = None  # (N, p) g_φv(v̂) (KDMCSE Eq. 6, DALR h^v)
    joint_text: torch.Tensor | None = None  # (N, k) t̂: raw cached joint-teacher caption features
    joint_image: torch.Tensor | None = None  # (N, k) v̂: raw cached joint-teacher image features
    shared_text: torch.Tensor | None = None  # (N, p) DALR consistency MLP on the sentence
    shared_image: torch.Tensor | None = None  # (N, p) DALR consistency MLP on the image
    text_teacher_sim: torch.Tensor | None = None  # (N, N) the text teachers' own similarity (raw L_CMA, L_IMA)
    rank_teacher_sim: torch.Tensor | None = None  # (N, N) the text teachers' ranking scores of L_rank
    text_teacher: torch.Tensor | None = None  # (N, p) DALR h^t = g_φt(Σ_k w_k F_k) (Eq. 3; projected Q^{t2t})
    phrases: torch.Tensor | None = None  # (T, p) projected phrase span means (MCSEO)
    objects: torch.Tensor | None = None  # (T, p) projected object-crop features (MCSEO)
    object_pair: torch.Tensor | None = None  # (T,) row of each object–phrase pair's caption
    mlm_logits: torch.Tensor | None = None  # (M, V) the LM head at the M tokens SimCSE's MLM chose
    mlm_labels: torch.Tensor | None = None  # (M,) their original token ids


def need(x: torch.Tensor | None, name: str, term: str) -> torch.Tensor:
    """``x``, or a clear error naming the term and the input this batch lacks."""
    if x is None:
        raise ValueError(f"loss term '{term}' needs {name}, which this batch does not carry")
    return x


def switch(value: bool | str, on_for: bool) -> bool:
    """A ``true | false | auto`` switch: ``auto`` is on where the method's paper uses the term."""
    return on_for if value == "auto" else bool(value)


@dataclass(frozen=True)
class Objective:
    """All a step's loss reads of a configuration: the method it trains (``train.method``) and the
    ``loss`` section. Loss terms see nothing else, so what a term may depend on is this class."""

    method: str
    loss: LossConfig

    @classmethod
    def of(cls, cfg: Config) -> Objective:
        return cls(cfg.train.method, cfg.loss)


def setting(o: Objective, path: str) -> float:
    """The value of a ``loss.`` parameter path (``loss.dalr.mu_iml``, as params.yaml spells it)."""
    section, *rest = path.split(".")
    if section != "loss" or not rest:
        raise ValueError(f"a loss term's weight is a loss.* parameter, got {path!r}")
    return float(functools.reduce(getattr, rest, o.loss))


@dataclass(frozen=True)
class LossTerm:
    """One loss term of the sentence encoders' step.

    - ``name``: its key in the step's dict and in MLflow (``loss/<name>``), the only place it is spelled;
    - ``equation``: the paper and equation it transcribes (docs and error messages);
    - ``active(o)``: its switch, read from the `Objective` (the method and the ``loss`` section);
    - ``weight``: the dotted parameter path of its weight in the sum (None: weight 1);
    - ``scale``: a second parameter path multiplying the weight, for a term weighted inside its group
      (DALR's authors' code sums 0.01·L_cons + L_CMA under λ);
    - ``inputs(o)``: the `StepEmbeddings` fields it reads (names of `INPUT_FEATURES`);
    - ``reads(o)``: the ``loss.*`` parameters its function reads under ``o`` (dotted paths), beside its switch,
      weight and inputs, which are read here: with them, what a job's identity keeps of ``loss``
      (`mmcse.methods.objectives.objective_keys`);
    - its function, ``compute(o, e, draw)`` (registered under ``name`` in :mod:`mmcse.methods.compute`):
      its value, or a dict holding ``name`` plus sub-terms and ``stat/…`` diagnostics; ``draw`` is what the
      term drew from its own CPU stream ahead of the step (``@draws``) when ``stream`` is set, else None;
    - ``on_pairs(o)``/``on_text(o)``: which batches it runs on (image–caption, text-only);
    - ``applies(e)``: False skips it for one batch (a pair batch without object–phrase pairs);
    - ``alone(o)``: on image–caption batches it replaces the text term and is summed unweighted
      (KDMCSE Algorithm 1), ``alone_reason`` saying why in a sweep's error; ``yields_to_alone``:
      this is the text term such a term replaces;
    - ``order``: its place in the sum (a fixed order keeps every step's float sum the same);
    - ``stream``: the number of its random stream (mismatched pairs, ranking ties), unique, so
      switching one term off leaves every other term's draws unchanged;
    - ``retrieval_head``: the trained image head and cached test features its image side gives
      retrieval (``(head, features)``), None when it trains no image side.
    """

    name: str
    equation: str
    order: int
    active: Callable[[Objective], bool]
    inputs: Callable[[Objective], set[str]]
    reads: Callable[[Objective], set[str]] = lambda o: set()
    weight: str | None = None
    scale: str | None = None
    on_pairs: Callable[[Objective], bool] = lambda o: True
    on_text: Callable[[Objective], bool] = lambda o: False
    applies: Callable[[StepEmbeddings], bool] = lambda e: True
    alone: Callable[[Objective], bool] = lambda o: False
    alone_reason: str = ""
    yields_to_alone: bool = False
    stream: int | None = None
    retrieval_head: tuple[str, str] | None = None

    def runs_on(self, o: Objective, pair_batch: bool) -> bool:
        return self.on_pairs(o) if pair_batch else self.on_text(o)


REGISTRY: dict[str, LossTerm] = {}


def register(*terms: LossTerm) -> None:
    """Add terms to the registry; a second term of one name, order or stream is refused."""
    for term in terms:
        for other in REGISTRY.values():
            if other.name == term.name:
                raise ValueError(f"loss term {term.name!r} is registered twice")
            if other.order == term.order:
                raise ValueError(f"loss terms {other.name!r} and {term.name!r} share order {term.order}")
            if term.stream is not None and other.stream == term.stream:
                raise ValueError(f"loss terms {other.name!r} and {term.name!r} share random stream {term.stream}")
        REGISTRY[term.name] = term
