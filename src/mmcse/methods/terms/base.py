"""What a loss term is: one object (`LossTerm`) in one module of this package, holding its name, equation, switch,
weight, the inputs it reads, the batches it runs on, its function and its random draws; the ``loss.<section>`` its
module adds to the configuration sits beside it (`loss_section`). A module is importable without torch (its
functions import it when they run), so a plan, a job's identity and the parameter check read every declaration in a
fraction of a second; the paper equations stay pure functions of tensors in :mod:`mmcse.methods.losses`.

Every module of :mod:`mmcse.methods.terms` registers its terms with :func:`register`; the package imports each
module it holds. What a configuration trains (`mmcse.methods.objectives.active_terms`), which cached features a
batch loads (`needed_features`), which student outputs a step computes (`needed_inputs`), which ``loss``
parameters a job's identity keeps (`objective_keys`) and the step's weighted sum
(`mmcse.methods.step.step_objective`) are all derived from the registered terms.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from mmcse.config import sections as generated

if TYPE_CHECKING:  # the tensors a step carries and the configuration's types; a declaration never makes one
    import torch

    from mmcse.config import Config, LossConfig

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


# a term's function: (objective, the step's embeddings, its draw or None) -> its value, or a dict holding its name,
# sub-terms and ``stat/…`` diagnostics
Compute = Callable[[Objective, StepEmbeddings, "torch.Tensor | None"], "torch.Tensor | dict[str, torch.Tensor]"]
# what a term with a random stream draws per step: (objective, pairs in the batch, its CPU generator) -> a CPU tensor
Draw = Callable[[Objective, int, "torch.Generator"], "torch.Tensor"]


@dataclass(frozen=True)
class LossTerm:
    """One loss term of the sentence encoders' step.

    - ``name``: its key in the step's dict and in MLflow (``loss/<name>``), the only place it is spelled;
    - ``equation``: the paper and equation it transcribes (docs and error messages);
    - ``order``: its place in the sum (a fixed order keeps every step's float sum the same);
    - ``active(o)``: its switch, read from the `Objective` (the method and the ``loss`` section);
    - ``weight``: the dotted parameter path of its weight in the sum (None: weight 1);
    - ``inputs(o)``: the `StepEmbeddings` fields it reads (names of `INPUT_FEATURES`);
    - ``on_pairs(o)``/``on_text(o)``: whether it runs on image–caption and on text-only batches;
    - ``compute(o, e, draw)``: its function (torch imported inside it): its value, or a dict holding ``name``
      plus sub-terms and ``stat/…`` diagnostics; ``draw`` is what the term drew from its own CPU stream ahead of
      the step (``draw``) when ``stream`` is set, else None. It reads no generator and no tensor's value on the
      host (``.item()``, ``if tensor:``), so the step stays one compiled graph;
    - ``reads(o)``: the ``loss.*`` parameters ``compute`` reads under ``o`` (dotted paths), beside its switch,
      weight and inputs, which are read here: with them, what a job's identity keeps of ``loss``
      (`mmcse.methods.objectives.objective_keys`; tests/methods/test_objectives.py checks every registered term's
      against what its function reads as it runs);
    - ``scale``: a second parameter path multiplying the weight, for a term weighted inside its group
      (DALR's authors' code sums 0.01·L_cons + L_CMA under λ);
    - ``applies(e)``: False skips it for one batch (a pair batch without object–phrase pairs);
    - ``alone(o)``: on image–caption batches it replaces the text term and is summed unweighted
      (KDMCSE Algorithm 1), ``alone_reason`` saying why in a sweep's error; ``yields_to_alone``:
      this is the text term such a term replaces;
    - ``stream`` and ``draw(o, n, generator)``: the number of its random stream (mismatched pairs, ranking ties),
      unique, so switching one term off leaves every other term's draws unchanged, and what it draws from it on
      the CPU before the step's tensor code (a draw needs a stream; SimCSE's MLM has a stream and no draw: the
      step draws its masks, which its encoder pass needs);
    - ``retrieval_head``: the trained image head and cached test features its image side gives
      retrieval (``(head, features)``), None when it trains no image side.
    """

    name: str
    equation: str
    order: int
    active: Callable[[Objective], bool]
    weight: str | None
    inputs: Callable[[Objective], set[str]]
    on_pairs: Callable[[Objective], bool]
    on_text: Callable[[Objective], bool]
    compute: Compute
    reads: Callable[[Objective], set[str]] = lambda o: set()
    scale: str | None = None
    applies: Callable[[StepEmbeddings], bool] = lambda e: True
    alone: Callable[[Objective], bool] = lambda o: False
    alone_reason: str = ""
    yields_to_alone: bool = False
    stream: int | None = None
    draw: Draw | None = None
    retrieval_head: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.draw is not None and self.stream is None:
            raise ValueError(f"loss term {self.name!r} draws ({self.draw.__qualname__}) without a random stream")

    def runs_on(self, o: Objective, pair_batch: bool) -> bool:
        return self.on_pairs(o) if pair_batch else self.on_text(o)


def always(o: Objective) -> bool:
    """``on_pairs``/``on_text`` of a term that runs on that batch kind whatever the configuration."""
    return True


def never(o: Objective) -> bool:
    """``on_pairs``/``on_text`` of a term that never runs on that batch kind."""
    return False


Section = TypeVar("Section")


def loss_section(name: str, doc: str) -> Callable[[type[Section]], type[Section]]:
    """The ``loss.<name>`` parameters a term module declares beside its terms (a frozen dataclass with
    ``__pydantic_config__ = SECTION``, each field's description the docstring under it; ``doc`` describes the
    section). The configuration is a lower layer than the terms, so `mmcse generate` copies each declared section
    into ``src/mmcse/config/sections.py``, which params.yaml, the schema and every `Config` use; this returns that
    copy, and a module whose declaration differs from its copy stops its import naming the command."""

    def use(cls: type[Section]) -> type[Section]:
        copy = generated.LOSS_SECTIONS.get(name)
        if copy is None or copy[0].__name__ != cls.__name__ or copy[1] != doc or _shape(copy[0]) != _shape(cls):
            raise ImportError(f"loss.{name} ({cls.__module__}.{cls.__name__}) differs from its copy in "
                              "src/mmcse/config/sections.py: run `mmcse generate`")
        return copy[0]

    return use


def _shape(cls: type) -> list[tuple[str, Any, Any]]:
    """A section's fields as (name, type as written, default) in order, what its copy must repeat."""
    return [(f.name, str(f.type), f.default if f.default is not dataclasses.MISSING else f.default_factory)
            for f in dataclasses.fields(cls)]


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
