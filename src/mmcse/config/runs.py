"""The sections of what is done with trained models: ``evaluate``, ``ablate`` and ``sweep``."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from mmcse.config.checks import check, fail
from mmcse.config.declared import SECTION, Bool, Int, Name, NonNegativeInt, PositiveInt, Str
from mmcse.config.inputs import TRANSFER_TASKS

# avg_embeddings_last: the embedding layer's output and the last layer averaged, "first-last avg." as SimCSE's
# evaluation.py computed it when SimCSE's paper printed its first-last rows (hidden_states[0]; fixed to the first
# layer, hidden_states[1], in 2022: princeton-nlp/SimCSE 206d7ae, #133, #285)
POOLERS = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2", "avg_embeddings_last")


@dataclass(frozen=True)
class TransferConfig:
    __pydantic_config__ = SECTION
    # SentEval's logistic-regression probe (mmcse.evaluation.transfer); defaults are SimCSE's "test" mode,
    # its "fasttest" mode is kfold 5, rmsprop, batch_size 128, tenacity 3, epoch_size 2.
    kfold: Annotated[Int, Field(ge=2)] = 10
    """folds (SimCSE's "fasttest": 5, rmsprop, batch_size 128, tenacity 3, epoch_size 2)"""
    optim: Literal["adam", "rmsprop"] = "adam"
    """adam (lr 1e-3) | rmsprop (lr 1e-2)"""
    batch_size: PositiveInt = 64
    """the probe's training batch"""
    tenacity: NonNegativeInt = 5
    """checks without held-out improvement before stopping"""
    epoch_size: PositiveInt = 4
    """epochs between checks"""
    max_epoch: Int = 200
    """the most epochs the probe trains, early stopping aside"""
    seed: Int = 1111
    """SentEval's seed: folds, hold-out splits, probe initialisation"""

    def validate(self, where: str) -> None:
        p = "evaluate.transfer."
        check(self.max_epoch >= self.epoch_size, where, p + "max_epoch", "must be >= evaluate.transfer.epoch_size")


@dataclass(frozen=True)
class RetrievalConfig:
    __pydantic_config__ = SECTION
    # Image–text retrieval on the test split of data.pairs (mmcse.evaluation.retrieval) with the
    # student's trained heads; methods without an image head (simcse) report none.
    enabled: Bool = True
    """with the trained heads (docs/evaluation.md); simcse has none and reports none"""
    block_size: PositiveInt = 1024
    """rows of the similarity matrix held at once (COCO 5K: 25k × 5k)"""
    examples: NonNegativeInt = 5
    """DALR Table 10: query captions listed with their nearest test captions"""
    examples_k: PositiveInt = 3
    """neighbours listed per query"""


@dataclass(frozen=True)
class NdcgConfig:
    __pydantic_config__ = SECTION
    # Graded NDCG@k of the retrieval (DUET, TERAN's protocol: mmcse.evaluation.ndcg) with caption
    # relevance from ROUGE-L and/or SPICE (Java + CoreNLP jars: `pip install -e ".[spice]"`);
    # the relevance matrices are the `relevance` stage's output. Empty: no NDCG.
    relevance: list[Str] = field(default_factory=lambda: ["rouge_l"])
    """caption relevance: rouge_l | spice (Java 8-14 + CoreNLP jars: pip install -e ".[spice]"); the relevance
    matrices are the relevance stage's output; []: no NDCG"""
    k: PositiveInt = 25
    """the cut-off k of NDCG@k (DUET: 25)"""

    def validate(self, where: str) -> None:
        p = "evaluate.ndcg."
        for kind in self.relevance:
            check(kind in ("rouge_l", "spice"), where, p + "relevance", f"unknown kind {kind!r}; valid: rouge_l, spice")
        check(len(set(self.relevance)) == len(self.relevance), where, p + "relevance", "names a kind twice")




@dataclass(frozen=True)
class EvaluateConfig:
    __pydantic_config__ = SECTION
    pooler: Literal["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2", "avg_embeddings_last"] = (
        "cls_before_pooler"
    )
    """cls | cls_before_pooler | avg | avg_first_last | avg_top2 | avg_embeddings_last"""
    batch_size: PositiveInt = 128
    """sentences per encoder pass in evaluation"""
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """SentEval's logistic-regression probe for data.transfer_tasks (SimCSE's "test" mode)"""
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    """image–text R@K on the test split of data.pairs (demo: its own test scenes)"""
    ndcg: NdcgConfig = field(default_factory=NdcgConfig)
    """graded NDCG@k of that retrieval (DUET / TERAN protocol; docs/evaluation.md)"""
    mteb: list[Name] = field(default_factory=list)
    """MTEB task names (or task types Reranking, Classification, Retrieval, STS: DALR Table 5), run by
    mmcse.evaluation.mteb; names are checked against mteb's registry (and the data sets loaded) before any
    encoding, not here: importing mteb costs seconds every stage would pay."""
    evaluators: list[Name] | Literal["all"] = "all"
    """The evaluators a configuration asks for, by name, or all: every registered one (`mmcse.evaluation.evaluators`,
    a module each); each runs where its inputs are there too (transfer: data.transfer_tasks, mteb: evaluate.mteb,
    retrieval: a test set)."""

    def validate(self, where: str) -> None:
        check(len(set(self.mteb)) == len(self.mteb), where, "evaluate.mteb", "task names repeat")
        check(self.evaluators == "all" or len(set(self.evaluators)) == len(self.evaluators), where,
              "evaluate.evaluators", "names repeat")


# `ablate.figures` (`mmcse.experiments.ablation_record.log_ablation_figures`)
ABLATION_FIGURES = ("sts_scatter", "tsne_clusters", "dropout_tsne", "neighbours", "teacher_ranks",
                    "teacher_similarities")
SENTENCE_FIGURES = ("dropout_tsne", "neighbours")  # figures that read ablate.sentences


@dataclass(frozen=True)
class AblateConfig:
    __pydantic_config__ = SECTION
    # name -> {dotted.param.key: value}; the empty override is the reference configuration.
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"mcse": {}, "simcse": {"train.method": "simcse"}}
    )
    """name -> dotted param overrides"""
    reference: Str = "mcse"
    """the variant every row is compared with (its significance test and deltas); a preset sets it"""
    plot_x: Str = ""
    """A numeric dotted key every variant sets: the table is also drawn as a line over it."""
    preset: Str = "none"
    """none, or a file <presets_dir>/<preset>.yaml (next to params.yaml) that replaces variants, reference and plot_x
    (its `base` overrides go into every variant), and seeds / turns on transfer where it names them."""
    presets_dir: Str = "ablations"
    """a preset replaces variants, reference and plot_x below (seeds and transfer where it names them)"""
    title: Str = ""
    """heading of the table (a preset sets its description)"""
    seeds: list[Int] = field(default_factory=lambda: [1])
    """seeds every variant trains on (each (variant, seed) one job; the table reports their mean); one seed: the
    quick start's table, no t-test (the demo's full table: -S 'ablate.seeds=[1,2,3]')"""
    retries: NonNegativeInt = 1
    """times a failed job is trained again (never one whose training diverged)"""
    metric: Str = "avg"
    """a column of the table: avg, an STS task, (with transfer) MR … transfer_avg, or a retrieval score: demo_rsum,
    coco_1k_i2t_R1 (R@K keyed RK), or rsum (of the data's test set; COCO: 1K)"""
    transfer: Bool = False
    """Also probe data.transfer_tasks for every job (the papers' ablation tables are STS only)."""
    fan_out: Literal["local", "deployment"] = "local"
    """local: every job in the ablation's own process, one after another; deployment: each job a flow run of Prefect
    deployment `ablation-job` (pool gpu), spread over the GPU workers."""
    test: Literal["paired", "independent"] = "paired"
    """The significance test of each row against the reference: paired by seed (every row trains on the same seeds),
    or independent (Student's two-sample t-test: KDMCSE Table 1, its presets)."""
    figures: list[Str] = field(default_factory=list)
    """Figures drawn from every row's job once the table is made (a paper figure comparing models): sts_scatter = gold
    against cosine similarity of each row's model on the STS test pairs (DALR Fig. 4); tsne_clusters = t-SNE + 50
    KMeans clusters of each row's embeddings of the same test captions (DALR Fig. 3) dropout_tsne = t-SNE of
    ablate.sentences under repeated dropout masks per row (KDMCSE Figs. 8-12); neighbours = top-3 neighbours of
    queries among one caption per training image, rows side by side (DALR Table 10); teacher_ranks /
    teacher_similarities = the joint teacher's statistics (KDMCSE Figs. 5 / 6)"""
    sentences: list[Str] = field(default_factory=list)
    """The sentences a figure encodes: dropout_tsne's sentences, neighbours' queries (sampled when empty)"""
    figure_captions: Literal["retrieval_test", "flickr30k", "coco"] = "retrieval_test"
    """The test captions tsne_clusters encodes: retrieval_test = the retrieval test set's; flickr30k / coco =
    Karpathy's test split of that data set, read from Karpathy's file whatever trains (DALR Fig. 3: COCO's). The
    demo world has neither: there they are its own test scenes' captions, and the figure says so."""
    caveats: dict[str, Name] = field(default_factory=dict)
    """Rows that are not their paper's row, each with why (a recipe mmcse lacks, a missing term, another caption set):
    a preset names them; `mmcse plan` and `mmcse report` print them beside the row"""
    reading: Literal["recipe", "printed", "code"] = "recipe"
    """Where a paper's printed text and its authors' code differ (`mmcse.config.readings`): recipe = each point as its
    paper's recipe sets it; printed = every row as its paper prints it; code = as its authors' code does"""
    skipped: dict[str, Name] = field(default_factory=dict)
    """Rows of the preset the profile cannot train (a teacher role it does not name), each with what it needs: set
    when the preset is expanded (`mmcse.experiments.recipes.expand_roles`); plan and report print them"""

    def validate(self, where: str) -> None:
        check(len(self.variants) >= 1, where, "ablate.variants", "needs at least one variant")
        both = sorted(set(self.skipped) & set(self.variants))
        check(not both, where, "ablate.skipped", f"{both} are also variants: a row is trained or skipped")
        unknown = sorted(set(self.caveats) - set(self.variants))
        check(not unknown, where, "ablate.caveats", f"{unknown} are not variants; variants: {sorted(self.variants)}")
        unknown = sorted(set(self.figures) - set(ABLATION_FIGURES))
        check(not unknown, where, "ablate.figures", f"unknown {unknown}; figures: {', '.join(ABLATION_FIGURES)}")
        for i, sentence in enumerate(self.sentences):
            check(isinstance(sentence, str) and bool(sentence.strip()), where, f"ablate.sentences[{i}]",
                  "must be a non-empty sentence")
        if self.sentences:
            check(any(f in SENTENCE_FIGURES for f in self.figures), where, "ablate.sentences",
                  f"no figure reads them; figures that do: {', '.join(SENTENCE_FIGURES)}")
        if "dropout_tsne" in self.figures:
            check(len(self.sentences) >= 2, where, "ablate.sentences",
                  "dropout_tsne needs at least 2 sentences to encode (KDMCSE Figs. 8-12 use 3)")
        if self.plot_x:
            for name, overrides in self.variants.items():
                value = overrides.get(self.plot_x) if isinstance(overrides, Mapping) else None
                check(
                    isinstance(value, int | float) and not isinstance(value, bool),
                    where,
                    f"ablate.variants.{name}",
                    f"must set a number for ablate.plot_x ({self.plot_x})",
                )
        check(
            self.reference in self.variants,
            where,
            "ablate.reference",
            f"'{self.reference}' is not a variant; variants: {sorted(self.variants)}",
        )
        check(len(self.seeds) >= 1, where, "ablate.seeds", "needs at least one seed")
        check(len(set(self.seeds)) == len(self.seeds), where, "ablate.seeds", "seeds repeat")
        check(self.transfer or (self.metric not in TRANSFER_TASKS and self.metric != "transfer_avg"),
               where, "ablate.metric", f"{self.metric!r} is a transfer-task score: needs ablate.transfer: true")
        for name, overrides in self.variants.items():
            check(
                isinstance(overrides, Mapping),
                where,
                f"ablate.variants.{name}",
                "must map dotted param keys to values",
            )


# The ablate.* keys a preset file (ablations/<name>.yaml, `ablate.preset`) sets, each typed as AblateConfig
# declares it: the preset replaces them (`transfer: true` turns transfer on; a preset never turns it off).
PRESET_SETS = ("variants", "reference", "plot_x", "seeds", "transfer", "metric", "test", "figures", "sentences",
               "figure_captions", "caveats")


def _preset_file() -> type:
    hints = typing.get_type_hints(AblateConfig, include_extras=True)
    own = [("description", Str | None), ("base", dict[str, Any] | None), ("rows_of", Name | None)]
    fields = [(name, tp, field(default=None)) for name, tp in own + [(k, hints[k] | None) for k in PRESET_SETS]]
    namespace = {"__pydantic_config__": SECTION, "__module__": __name__}
    return dataclasses.make_dataclass("PresetFile", fields, frozen=True, namespace=namespace)


# A preset file's declaration: its own keys (description: the table's title; base: overrides every row gets;
# rows_of: another preset whose keys this one does not set) and the PRESET_SETS, all optional.
PresetFile = _preset_file()


@dataclass(frozen=True)
class SweepConfig:
    __pydantic_config__ = SECTION
    study_name: Name = "mmcse-sweep"
    """the Optuna study: a rerun with the same name and storage continues it"""
    storage: Name = "sqlite:///mlruns/optuna.db"
    """the Optuna storage URL (trials survive a crash and resume)"""
    n_trials: PositiveInt = 8
    """finished trials (complete or pruned) the study holds when the sweep ends, over every worker on its storage"""
    direction: Literal["maximize", "minimize"] = "maximize"
    """maximize | minimize the sweep's objective (the dev score)"""
    space: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "loss.lambda_img": {"type": "float", "low": 0.001, "high": 1.0, "log": True},
            "loss.temperature": {"type": "float", "low": 0.02, "high": 0.1},
        }
    )
    """dotted.param.key -> {type: float|int|categorical, low, high, log, choices}"""
    pruner_startup_trials: NonNegativeInt = 2
    """trials run to completion before the median pruner stops any"""
    pruner_warmup_steps: NonNegativeInt = 0
    """dev evaluations of a trial before the median pruner may stop it"""

    def validate(self, where: str) -> None:
        check(len(self.space) >= 1, where, "sweep.space", "needs at least one parameter")
        for key, spec in self.space.items():
            k = f"sweep.space.{key}"
            check(isinstance(spec, Mapping), where, k, "must be a mapping with a 'type'")
            kind = spec.get("type")
            if kind in ("float", "int"):
                allowed = {"type", "low", "high", "log", "step"}
                check("low" in spec and "high" in spec, where, k, "needs 'low' and 'high'")
                check(spec["low"] < spec["high"], where, k, "'low' must be < 'high'")
                if spec.get("log"):
                    check(spec["low"] > 0, where, k, "'low' must be > 0 with log: true")
            elif kind == "categorical":
                allowed = {"type", "choices"}
                check(bool(spec.get("choices")), where, k, "needs non-empty 'choices'")
            else:
                fail(where, k, f"type must be one of ['categorical', 'float', 'int'], got {kind!r}")
            extra = set(spec) - allowed
            check(not extra, where, k, f"unknown keys {sorted(extra)}; valid keys: {sorted(allowed)}")
