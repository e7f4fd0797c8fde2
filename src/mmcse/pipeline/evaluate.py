"""Stage ``evaluate``: the best checkpoint's test scores, logged into its training run."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np

from mmcse import tracking
from mmcse.config import RETRIEVAL_METHODS, Config, with_overrides
from mmcse.data.images import ImagePixels
from mmcse.data.senteval import TRANSFER_TASKS, SentencePair, TransferExample
from mmcse.detection.regions import RegionStore
from mmcse.environment import environment
from mmcse.errors import InputError, TrainingDiverged
from mmcse.evaluation.evaluators import (
    EvaluationInputs,
    EvaluatorProgress,
    asked_evaluators,
    build_evaluators,
    run_evaluators,
)
from mmcse.evaluation.evaluators.sts import STSEvaluator
from mmcse.evaluation.figures import TSNE_CLUSTERS, TSNE_POINTS, sample_sentences, tsne_figure
from mmcse.evaluation.mteb import encoder_details, prepare_tasks, results_folder
from mmcse.evaluation.names import test_metrics
from mmcse.evaluation.ndcg import test_set_ndcg
from mmcse.evaluation.plots import save_figure, sts_scatter
from mmcse.evaluation.retrieval import (
    chance_metrics,
    evaluate_test_set,
    neighbours_markdown,
    sentence_neighbours,
    test_set_metrics,
    unit_rows,
)
from mmcse.evaluation.sts import COLLAPSED_TAG, TextEncoder, collapsed_message, encode_unique, group_by_task
from mmcse.integrity.files import check_model_folder
from mmcse.integrity.keys import require_top_level
from mmcse.io import read_json, read_jsonl, write_text
from mmcse.methods.objectives import Objective, image_head
from mmcse.models.card import CARD, write_model_card
from mmcse.models.device import resolve_device, with_base_threads
from mmcse.models.export import log_mlflow_model
from mmcse.models.tokens import cached_tokens
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.relevance import relevance_for
from mmcse.tracking.lineage import MODEL_URI_TAG, describe_with_card
from mmcse.training.batches import teacher_set_folder
from mmcse.training.checkpoints import code_change, run_definition_hash
from mmcse.training.duet import RetrievalSplit, load_duet, split_embeddings
from mmcse.training.engine import Hooks
from mmcse.training.loop import train

log = logging.getLogger(__name__)


def require_trained_with(cfg: Config, model_dir: Path) -> str:
    """Check that the checkpoint ``model_dir`` is whole (headers, every file against its seal's SHA-256)
    and was trained with ``cfg`` by this library code (its seal's `run_definition_hash`); returns that
    hash. Anything else is one line naming the folder and what to run: a result always comes from its
    configuration's training."""

    fix = "rerun the train stage (dvc repro train)"
    sealed = check_model_folder(model_dir, fix)
    expected = run_definition_hash(cfg)
    if sealed is None:
        raise InputError(f"{model_dir}: no checkpoint seal (written by an older mmcse, or not by the train stage), "
                         f"so which configuration trained it is unknown; {fix}")
    if sealed.get("config_hash") != expected:
        if (changed := code_change(sealed)) is not None:
            raise InputError(f"{model_dir}: {changed}; {fix}")
        raise InputError(f"{model_dir}: trained with another configuration than params.yaml's (its seal records "
                         f"{str(sealed.get('config_hash'))[:12]}, params.yaml makes {expected[:12]}); {fix}")
    return expected


@dataclass(frozen=True)
class EvalOutputs:
    """Where an evaluation's results go: into the training run ``run_id`` (of ``experiment``, default the
    method), the stage's ``plots_dir`` (figures, ``sentence_retrieval.md``; None: an ablation job, which skips
    the t-SNE) and mteb's results folder ``mteb_dir``."""

    run_id: str | None = None
    experiment: str | None = None
    plots_dir: Path | None = None
    mteb_dir: Path | None = None


@dataclass(frozen=True)
class TrainedOn:
    """What the evaluated model was trained with: its data folder (default ``paths.raw``; a job's test sets
    are the same by construction: `mmcse.experiments.upstream.FIXED_KEYS`), the teacher manifest and the
    folders its sets are looked up in, and a retrieval model's region sets (`region_sets_for`)."""

    data_dir: Path | None = None
    teacher_manifest: Path | None = None
    teacher_dirs: tuple[Path, ...] = ()
    region_sets: dict[str, Path] = field(default_factory=dict)


@dataclass
class EvaluationMade:
    """What one evaluation made besides its scores: the STS scatter (``log_scatter``: into the run too), the
    nearest-caption ``examples``, the ``tsne`` figure, ``dicts`` (artifact path -> JSON), the evaluated
    ``model`` = (sentence-transformers folder, example sentences), run ``tags``, its wall-clock ``minutes``
    and ``folders`` (artifact path -> folder, e.g. mteb's results)."""

    sts_scatter: Any
    examples: str | None = None
    tsne: Any = None
    dicts: dict[str, Any] = field(default_factory=dict)
    log_scatter: bool = True
    model: tuple[Path, list[str]] | None = None
    tags: dict[str, str] = field(default_factory=dict)
    minutes: float | None = None
    folders: dict[str, Path] = field(default_factory=dict)


def _test_data(raw: Path, transfer: bool) -> tuple[dict[str, list[SentencePair]], dict[str, list[TransferExample]]]:
    """The test STS tasks in ``raw`` and, with ``transfer``, the SentEval transfer tasks there."""
    tasks = group_by_task([SentencePair.from_row(r) for r in read_jsonl(raw / "sts" / "test.jsonl")])
    if not tasks:
        raise InputError(f"{raw / 'sts' / 'test.jsonl'}: no STS pairs to evaluate; rerun the download stage")
    transfer_files = [raw / "transfer" / f"{t}.jsonl" for t in TRANSFER_TASKS] if transfer else []
    return tasks, {f.stem: [TransferExample.from_row(r) for r in read_jsonl(f)] for f in transfer_files if f.is_file()}


def _tsne(cfg: Config, encoder: TextEncoder, tasks: dict[str, list[SentencePair]]) -> tuple[Any, float]:
    """DALR Figure 3 for the stage's model: a t-SNE map of a sample of the test sentences and its clusters'
    silhouette."""
    sample = sample_sentences([s for pairs in tasks.values() for p in pairs for s in (p.s1, p.s2)],
                              TSNE_POINTS, cfg.base.seed)
    vectors = encode_unique(encoder, sample, cfg.evaluate.batch_size, desc="t-SNE sentences")
    tsne, clusters = tsne_figure(np.stack([vectors[s] for s in sample]), n_clusters=TSNE_CLUSTERS,
                                 seed=cfg.base.seed, title=cfg.train.method)
    return tsne, clusters["silhouette"]


def _carded(cfg: Config, paths: Paths, trained_on: TrainedOn, model_dir: Path, scores: dict[str, float],
            test_set: Any) -> dict[str, float]:
    """The model card of a student mmcse trained, beside its untrained reference and retrieval's chance; returns
    the untrained reference's scores."""
    chance = (chance_metrics(test_set.set_name, test_set.text_image, test_set.image_emb.shape[0])
              if test_set is not None and test_set.image_emb is not None else None)
    untrained = untrained_scores(cfg, paths, trained_on)
    write_model_card(model_dir, cfg, scores, environment(cfg.base.device), chance=chance, untrained=untrained)
    return untrained


@with_base_threads
def run_evaluate(cfg: Config, paths: Paths, model_dir: Path, outputs: EvalOutputs | None = None,
                 trained_on: TrainedOn | None = None, transfer: bool = True) -> dict[str, float]:
    """Test-set STS of the checkpoint at ``model_dir`` and, with ``transfer``, SentEval's transfer
    tasks found in ``data/raw/transfer`` (``data.transfer_tasks``: accuracy per task and
    ``transfer_avg``); logged into the training run ``outputs.run_id`` (metrics ``test_<name>``, STS
    scatter figure), the scatter also saved to ``outputs.plots_dir``; ``trained_on``: what the model was
    trained with (`TrainedOn`).

    With ``evaluate.retrieval.enabled`` and a retrieval test set in the data: image–text R@K
    through the method's trained heads (`mmcse.evaluation.retrieval.image_head`; image features
    from the sets ``trained_on.teacher_manifest`` names, default ``<teachers>/manifest.json``, looked up in
    ``paths.teachers`` then ``trained_on.teacher_dirs``), keys ``<set>_i2t_R1`` … ``<set>_rsum``,
    graded ``<set>_{i2t,t2i}_NDCG<k>_<kind>`` (`mmcse.evaluation.names`) for
    ``evaluate.ndcg.relevance`` (`relevance_for`), and DALR Table 10's nearest test captions
    (``sentence_retrieval.md`` in ``plots_dir`` and the run).

    ``train.method: duet``: `evaluate_duet` (on ``trained_on.region_sets``)."""
    outputs, trained_on = outputs or EvalOutputs(), trained_on or TrainedOn()
    plots_dir, mteb_dir = outputs.plots_dir, outputs.mteb_dir
    model_name = f"mmcse/{cfg.train.method}"  # mteb's name for it (its results folder, DALR Table 5)
    if cfg.train.method in RETRIEVAL_METHODS:  # an image–text retrieval model: no sentence-embedding tasks
        with results_folder(mteb_dir, model_name, {}, [], f"{cfg.train.method} is an image–text retrieval "
                            "model, with no sentence-embedding tasks"):
            return evaluate_duet(cfg, paths, model_dir, outputs, trained_on)
    # MTEB names and datasets are checked before any model loads: offline, a missing dataset is named here
    mteb_tasks = prepare_tasks(cfg.evaluate.mteb, "evaluate.mteb") if cfg.evaluate.mteb else []
    started = time.perf_counter()  # the evaluation's minutes go to the run (`mmcse.experiments.estimate`)
    device = resolve_device(cfg.base.device)
    encoder = TextEncoder(str(model_dir), cfg.evaluate.pooler, str(device), precision=cfg.train.precision)
    raw = trained_on.data_dir or paths.raw
    tasks, transfer_tasks = _test_data(raw, transfer)
    manifest = read_json(raw / "manifest.json") if (raw / "manifest.json").is_file() else {}
    # retrieval goes through the student's heads: a plain HF model (mmcse eval of any encoder) has none
    retrieval = cfg.evaluate.retrieval.enabled and manifest.get("retrieval_set") and encoder.student is not None
    found: dict[str, Any] = {}  # the retrieval test set, for its nearest-caption examples

    def retrieval_scores(_: Any) -> dict[str, float]:
        found["test_set"] = retrieval_test_set(cfg, paths, encoder, raw, trained_on.teacher_manifest,
                                               trained_on.teacher_dirs)
        return found["test_set"].scores

    # model_meta.json of mteb's results: the checkpoint's revision and sizes, the English base model it came from
    details = {**encoder_details(encoder, model_dir), "languages": ["eng-Latn"],
               "adapted_from": cfg.model.name_or_path} if mteb_tasks else {}
    with results_folder(mteb_dir, model_name, details, [t.metadata.name for t in mteb_tasks]) as mteb_output:
        evaluators = build_evaluators(EvaluationInputs(
            # DALR Table 6 / Appendix D: alignment (dev pairs with gold >= 4), uniformity (all dev sentences)
            sts=tasks, dev=[SentencePair.from_row(r) for r in read_jsonl(raw / "sts" / "dev.jsonl")],
            transfer=transfer_tasks, transfer_probe=cfg.evaluate.transfer,
            mteb=mteb_tasks, mteb_model_name=model_name, mteb_output=mteb_output, mteb_details=details,
            retrieval=retrieval_scores if retrieval else None, data_dir=raw, batch_size=cfg.evaluate.batch_size,
            device=str(device), asked=asked_evaluators(cfg.evaluate.evaluators),
        ))
        # the stage's student as an MLflow model of its run (ablation jobs and trials would copy one per job), with
        # its model card (README.md: sentence-transformers keeps a folder's card when it saves the model) when mmcse
        # trained it; the card's untrained reference is the stage's last step
        published = plots_dir is not None and (Path(model_dir) / "modules.json").is_file()
        carded = published and (Path(model_dir) / "train_state.json").is_file()
        steps = EvaluatorProgress([e.label for e in evaluators] + (["t-SNE"] if plots_dir is not None else [])
                                  + (["untrained reference"] if carded else []),
                                  show=plots_dir is not None)  # the stage shows it; an ablation job prints its line
        scores = run_evaluators(evaluators, encoder, steps)
    # the STS scores' figure and per-pair predictions where the sts evaluator ran (any subset of evaluators may)
    result = next((e.result for e in evaluators if isinstance(e, STSEvaluator)), None)
    test_set = found.get("test_set")
    examples = (neighbours_markdown(test_set.examples, f"Nearest test captions ({test_set.set_name}, "
                                    f"{cfg.evaluate.pooler} embeddings)") if test_set and test_set.examples else None)
    fig = (sts_scatter(result.predictions, result.task_scores) if result is not None else
           notice_figure("no STS test scores: evaluate.evaluators does not ask for sts"))
    tsne = None
    if plots_dir is not None:  # DALR Figure 3 for the stage's model (ablation jobs skip its seconds of t-SNE)
        steps.next()
        tsne, scores["cluster_silhouette"] = _tsne(cfg, encoder, tasks)
    # per-pair predictions, so figures comparing runs (`mmcse figures`) need no re-encoding
    predictions = {task: {"cos": cos.tolist(), "gold": gold.tolist()}
                   for task, (cos, gold) in (result.predictions.items() if result is not None else ())}
    untrained: dict[str, float] | None = None
    if carded:  # mmcse trained it: the card says how
        steps.next()
        untrained = _carded(cfg, paths, trained_on, model_dir, scores, test_set)
    steps.close()
    model = (model_dir, [p.s1 for pairs in tasks.values() for p in pairs[:2]]) if published else None
    minutes = (time.perf_counter() - started) / 60.0
    dicts = {**({"evaluation/sts_predictions.json": predictions} if result is not None else {}),
             **({"evaluation/untrained_scores.json": untrained} if untrained else {})}
    collapsed = result.collapsed if result is not None else []
    record_evaluation(cfg, scores, outputs, EvaluationMade(
        fig, examples, tsne, dicts, log_scatter=result is not None, model=model,
        folders={"mteb": mteb_dir} if mteb_dir is not None and mteb_tasks else {},
        tags={COLLAPSED_TAG: collapsed_message(collapsed)} if collapsed else {}, minutes=minutes))
    if outputs.run_id:  # beside the run's record too: a plan's estimate reads it without MLflow
        tracking.note_run(Path(model_dir).parent, eval_minutes=minutes)
    return scores


UNTRAINED_EVALUATORS = ("sts", "geometry", "retrieval")  # the untrained reference's: its seconds, not minutes


def untrained_scores(cfg: Config, paths: Paths, trained_on: TrainedOn) -> dict[str, float] | None:
    """The scores of the encoder a training of ``cfg`` starts from — ``model.name_or_path`` with the method's
    heads as initialised at step 0 (``train.epochs: 0``, made in a scratch folder removed after) — on the same
    test sets (STS, geometry, retrieval: `UNTRAINED_EVALUATORS`): the model card's "untrained" column, so
    what training added reads beside what the start already scored. None when no dev evaluation of it gives a
    finite score (nothing to hold as a checkpoint)."""

    initial = with_overrides(cfg, {"train.epochs": 0, "evaluate.mteb": [], "evaluate.retrieval.examples": 0,
                                   "evaluate.evaluators": list(UNTRAINED_EVALUATORS)}, where="the untrained reference")
    raw = trained_on.data_dir or paths.raw
    teachers = trained_on.teacher_manifest.parent if trained_on.teacher_manifest else paths.teachers
    with tempfile.TemporaryDirectory(prefix="mmcse-untrained-") as scratch:
        try:
            start = train(initial, raw, teachers, Path(scratch) / "untrained", Hooks(progress=False))
        except TrainingDiverged as err:
            log.warning("no untrained reference on the model card: %s", err)
            return None
        return run_evaluate(initial, paths, start.best_dir, trained_on=trained_on, transfer=False)


def record_evaluation(cfg: Config, scores: dict[str, float], outputs: EvalOutputs, made: EvaluationMade) -> None:
    """What an evaluation leaves behind: into training run ``outputs.run_id`` the scores (``test_<name>``), the
    nearest-caption examples, the t-SNE and STS-scatter figures (``made.log_scatter``), ``made.dicts``
    and ``made.model`` as an MLflow model (`mmcse.models.export.log_mlflow_model`, its URI in the run's tag
    ``mmcse.model_uri``), ``made.tags`` (e.g. `mmcse.evaluation.sts.COLLAPSED_TAG`) and the evaluation's
    wall-clock ``minutes`` (`tracking.EVAL_MINUTES`, never in the scores: they are DVC metrics), the
    ``folders``; into ``outputs.plots_dir`` (the evaluate stage's DVC outputs) ``sts_scatter.png``,
    ``sentence_retrieval.md`` and ``tsne.png``. Figures are closed either way."""
    import matplotlib.pyplot as plt

    if outputs.run_id:
        with tracking.run(cfg, outputs.experiment or cfg.train.method, run_id=outputs.run_id):
            mlflow.log_metrics(test_metrics(scores))
            if made.minutes is not None:
                mlflow.log_metric(tracking.EVAL_MINUTES, made.minutes)
            if made.tags:
                mlflow.set_tags(made.tags)
            if made.examples:
                mlflow.log_text(made.examples, "evaluation/sentence_retrieval.md")
            if made.tsne is not None:
                mlflow.log_figure(made.tsne, "figures/tsne.png")
            if made.log_scatter:
                mlflow.log_figure(made.sts_scatter, "figures/sts_scatter.png")
            for artifact, value in made.dicts.items():
                mlflow.log_dict(value, artifact)
            for artifact, folder in made.folders.items():
                mlflow.log_artifacts(str(folder), artifact)
            if made.model is not None:
                uri = log_mlflow_model(*made.model)
                mlflow.set_tag(MODEL_URI_TAG, uri)
                card = Path(made.model[0]) / CARD
                if card.is_file():  # the model card as the run's and the model's description
                    describe_with_card(card.read_text(), outputs.run_id, uri)
    plots_dir = outputs.plots_dir
    if plots_dir is not None:
        save_figure(made.sts_scatter, plots_dir / "sts_scatter.png")
        # the stage's outputs persist (dvc.yaml): one this evaluation does not make must not stay as an older one's
        if made.examples:
            write_text(plots_dir / "sentence_retrieval.md", made.examples)
        else:
            (plots_dir / "sentence_retrieval.md").unlink(missing_ok=True)
        if made.tsne is not None:
            save_figure(made.tsne, plots_dir / "tsne.png")
        else:
            (plots_dir / "tsne.png").unlink(missing_ok=True)
    else:
        plt.close(made.sts_scatter)


def notice_figure(text: str) -> Any:
    """A figure that only says ``text``: the stage's ``sts_scatter.png`` (a DVC output) where no STS score was made."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    return fig


def evaluate_duet(cfg: Config, paths: Paths, model_dir: Path, outputs: EvalOutputs | None = None,
                  trained_on: TrainedOn | None = None) -> dict[str, float]:
    """DUET's test scores (§5.1) through the shared evaluators: R@1/5/10 both ways and rsum
    (`mmcse.evaluation.retrieval.test_set_metrics`: COCO 5K and 1K folds, Flickr30k 1K) and graded
    NDCG@k per ``evaluate.ndcg.relevance`` (`relevance_for`), on v_I / v_C of the checkpoint at
    ``model_dir`` with the test region set ``trained_on.region_sets["test"]``. Also: the test captions' nearest
    neighbours in the joint space (``sentence_retrieval.md``) and the t-SNE of the caption embeddings
    with cluster purity against their images (``tsne.png``, ``cluster_silhouette``,
    ``cluster_purity``); ``sts_scatter.png`` says that a retrieval model has no STS scores."""

    outputs, trained_on = outputs or EvalOutputs(), trained_on or TrainedOn()
    raw = trained_on.data_dir or paths.raw
    manifest = read_json(raw / "manifest.json")
    set_name = manifest.get("retrieval_set")
    if not set_name:
        raise InputError(f"{raw}: no retrieval test set (data.pairs: {cfg.data.pairs}); DUET is scored by retrieval")
    split, image_emb, text_emb = duet_test_embeddings(cfg, raw, model_dir, trained_on.region_sets.get("test"))
    block = cfg.evaluate.retrieval.block_size
    scores = test_set_metrics(set_name, image_emb, text_emb, split.text_image, block)
    if cfg.evaluate.ndcg.relevance:
        relevance = {kind: relevance_for(paths, split.captions, split.text_image, kind)
                     for kind in cfg.evaluate.ndcg.relevance}
        scores |= test_set_ndcg(set_name, image_emb, text_emb, split.text_image, relevance, cfg.evaluate.ndcg.k,
                                block)
    r = cfg.evaluate.retrieval
    examples = None
    if r.examples:
        rows = sentence_neighbours(split.captions, text_emb, split.text_image, r.examples, r.examples_k)
        examples = neighbours_markdown(
            rows, f"Nearest test captions ({set_name}, {cfg.train.method} v_C in the joint space)")
    tsne = None
    if outputs.plots_dir is not None:  # the captions of each image should share a cluster: purity against the image
        tsne, clusters = tsne_figure(unit_rows(text_emb), n_clusters=TSNE_CLUSTERS, seed=cfg.base.seed,
                                     groups=split.text_image, max_points=TSNE_POINTS,
                                     title=f"{cfg.train.method} captions")
        scores |= {f"cluster_{k}": v for k, v in clusters.items() if k in ("silhouette", "purity")}
    no_sts = notice_figure(f"train.method {cfg.train.method} is an image–text retrieval model:\n"
                           "no STS scores (see eval.json: R@K, NDCG)")
    record_evaluation(cfg, scores, outputs, EvaluationMade(no_sts, examples, tsne, log_scatter=False))
    return scores


def duet_test_embeddings(cfg: Config, raw: Path, model_dir: Path, test_regions: Path | None) -> tuple[Any, Any, Any]:
    """The test split of ``raw`` (`mmcse.training.duet.RetrievalSplit` on the region set ``test_regions``,
    or the images' pixels for a VSE++ that runs its CNN) and a DUET checkpoint's v_I ``(N_img, D)`` and v_C
    ``(N_txt, D)`` of it (Eq. 27)."""

    device = resolve_device(cfg.base.device)
    model, tokenizer = load_duet(model_dir, device)
    images, captions = raw / "retrieval" / "images.jsonl", raw / "retrieval" / "captions.jsonl"
    if getattr(model, "reads_pixels", False):
        ids = [row["image_id"] for row in read_jsonl(images)] if images.is_file() else []
        source: Any = ImagePixels(raw, ids, model.crop_size, cfg.teachers.num_workers)
    elif test_regions is None:
        raise FileNotFoundError(f"{model_dir}: no test region set recorded for this training; rerun it "
                                "(dvc repro train)")
    else:
        source = RegionStore.open(test_regions)
    split = RetrievalSplit.load(images, captions, source)
    tokens = cached_tokens(raw.parent / "tokens", "test_captions", tokenizer, split.captions, cfg.model.max_seq_len)
    image_emb, text_emb = split_embeddings(model, split, tokens, cfg.evaluate.batch_size, device,
                                           cfg.train.precision)
    return split, image_emb, text_emb


def retrieval_test_set(cfg: Config, paths: Paths, encoder: Any, raw: Path, teacher_manifest: Path | None = None,
                       teacher_dirs: tuple[Path, ...] = (), head: Any = "config") -> Any:
    """`mmcse.evaluation.retrieval.evaluate_test_set` on ``<raw>/retrieval`` with the image features
    the teacher manifest names, plus graded NDCG (``evaluate.ndcg``, relevance from `relevance_for`)
    in its scores: what the evaluate stage and ``mmcse eval --retrieval`` report."""

    manifest = read_json(raw / "manifest.json")
    sets = read_json(teacher_manifest or paths.teachers / "manifest.json")["sets"]
    folders = {name: teacher_set_folder(sets[name], paths.teachers, teacher_dirs)
               for name in ("retrieval_image", "retrieval_joint_image") if name in sets}
    head = image_head(Objective.of(cfg)) if head == "config" else head
    test_set = evaluate_test_set(cfg.evaluate, encoder, raw, folders, manifest["retrieval_set"], head)
    if test_set.image_emb is not None and cfg.evaluate.ndcg.relevance:
        relevance = {kind: relevance_for(paths, test_set.captions, test_set.text_image, kind)
                     for kind in cfg.evaluate.ndcg.relevance}
        test_set.scores |= test_set_ndcg(test_set.set_name, test_set.image_emb, test_set.text_emb,
                                         test_set.text_image, relevance, cfg.evaluate.ndcg.k,
                                         cfg.evaluate.retrieval.block_size)
    return test_set


def checkpoint_retrieval(cfg: Config, paths: Paths, encoder: Any, model_dir: Path) -> dict[str, float]:
    """``mmcse eval --retrieval``: R@K and NDCG of a best checkpoint (``train_state.json`` records
    its method's image head) on the retrieval test set of ``cfg``'s top-level artifacts, refused
    when they were made from another configuration (`mmcse.integrity.keys.require_top_level`)."""

    state_file = Path(model_dir) / "train_state.json"
    if state_file.is_file() and read_json(state_file).get("method") in RETRIEVAL_METHODS:
        return checkpoint_duet_retrieval(cfg, paths, Path(model_dir), read_json(state_file))
    if encoder.student is None or not state_file.is_file():
        raise FileNotFoundError(f"{state_file}: not an mmcse best checkpoint; --retrieval scores a student's "
                                "trained image head (models/student/best)")
    state = read_json(state_file)
    if "image_head" not in state:
        raise InputError(f"{state_file}: written before checkpoints recorded their image head; retrain it "
                         "(dvc repro train) or use the evaluate stage")
    up = require_top_level(cfg, paths)
    if not read_json(up.raw / "manifest.json").get("retrieval_set"):
        raise InputError(f"{up.raw}: no retrieval test set (data.pairs: {cfg.data.pairs})")
    head = tuple(state["image_head"]) if state["image_head"] else None
    return retrieval_test_set(cfg, paths, encoder, up.raw, up.teacher_manifest, up.teacher_dirs, head).scores


def checkpoint_duet_retrieval(cfg: Config, paths: Paths, model_dir: Path, state: dict[str, Any]) -> dict[str, float]:
    """``mmcse eval --retrieval`` of a DUET checkpoint: `evaluate_duet` on the test region set its
    training recorded (``train_state.json``), found in the cache_regions folder or
    ``<data>/upstream/regions``, on ``cfg``'s top-level artifacts (refused when stale)."""

    up = require_top_level(cfg, paths)
    if state.get("image_input") == "pixels":  # VSE++ with its CNN: it reads the test images themselves
        return evaluate_duet(cfg, paths, model_dir, trained_on=TrainedOn(up.raw))
    test = checkpoint_test_regions(paths, model_dir, state)
    return evaluate_duet(cfg, paths, model_dir, trained_on=TrainedOn(up.raw, region_sets={"test": test}))


def checkpoint_test_regions(paths: Paths, model_dir: Path, state: dict[str, Any]) -> Path:
    """The test region set a DUET checkpoint's training recorded (``train_state.json``), in the
    cache_regions folder or ``<data>/upstream/regions``."""
    name = (state.get("region_sets") or {}).get("test")
    folders = [d / name for d in (paths.regions, paths.raw.parent / "upstream" / "regions")] if name else []
    found = [f for f in folders if (f / "index.json").is_file()]
    if not found:
        raise FileNotFoundError(f"{model_dir / 'train_state.json'}: its test region set "
                                f"{name or '(not recorded)'} is in neither {paths.regions} nor "
                                f"{paths.raw.parent / 'upstream' / 'regions'}: rerun cache_regions (dvc repro)")
    return found[0]
