"""MTEB tasks (reranking, retrieval, classification, STS…) through the ``mteb`` package (2.x).

DALR's Table 5 reports the MTEB English averages of four task types — Re-Rank, CLF, Retrieval,
STS — the SimCSE row taken from the MTEB paper (Muennighoff et al., 2023), i.e. the task types'
tasks of the ``MTEB(eng, v1)`` benchmark. A task name is resolved against that benchmark first
(so ``STS17`` is its English ``en-en`` subset and ``MTOPIntentClassification`` its ``en`` one, as
in the paper's numbers), then against mteb's whole registry; a task type of :data:`TABLE5_TYPES`
names all of that type's tasks of the benchmark (``Reranking`` -> its 4 tasks).

Scores: ``mteb_<Task>`` is the task's main score x 100 (cosine Spearman for STS, accuracy for
classification, MAP@1000 for reranking, nDCG@10 for retrieval); ``mteb_type_<Type>`` the mean over
the tasks of a type (Table 5's columns); ``mteb_avg`` (PRIMARY) the mean over all tasks.

Data: every task's data set is loaded before anything is encoded, so a data set that is neither
reachable nor in the local Hugging Face cache (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``)
fails at once with :class:`MTEBDataMissing`, naming the task, the HF data set id and how to fill
the cache. The model is mmcse's ``EncodeFn`` (:class:`mmcse.evaluation.sts.TextEncoder`: the same
encoder and pooler as ``mmcse eval``) wrapped by :class:`EncodeFnModel`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from mmcse.errors import MTEBDataMissing, MTEBTaskError
from mmcse.evaluation.names import MTEB_PRIMARY
from mmcse.evaluation.sts import EncodeFn, TextEncoder, encode_unique
from mmcse.integrity.files import read_seal
from mmcse.io import build_dir, swap_in_dir, write_text

if TYPE_CHECKING:
    from mteb import AbsTask

PRIMARY_METRIC = MTEB_PRIMARY
BENCHMARK = "MTEB(eng, v1)"
# DALR Table 5's columns (Re-Rank, CLF, Retrieval, STS) as mteb task types
TABLE5_TYPES = ("Reranking", "Classification", "Retrieval", "STS")


def _benchmark_tasks() -> dict[str, AbsTask]:
    import mteb

    # mteb caches the benchmark: its task objects (and their loaded data) are shared by every caller
    return {t.metadata.name: t for t in mteb.get_benchmark(BENCHMARK).tasks}


def task_names() -> list[str]:
    """Every name :func:`resolve_tasks` accepts: mteb's registry and the task types of Table 5."""
    import mteb

    return sorted({t.metadata.name for t in mteb.get_tasks()}) + list(TABLE5_TYPES)


def resolve_tasks(tasks: Sequence[str | AbsTask], where: str = "mteb") -> list[AbsTask]:
    """Task objects for names (or task objects, kept as they are), in order, without repeats.

    An unknown name raises one :class:`MTEBTaskError` listing the close valid names."""
    import mteb

    if isinstance(tasks, str):
        tasks = [tasks]
    if not tasks:
        raise MTEBTaskError(f"{where}: no MTEB task named")
    named = any(isinstance(t, str) for t in tasks)
    bench = _benchmark_tasks() if named else {}
    out: dict[str, AbsTask] = {}
    unknown: list[str] = []
    for item in tasks:
        if not isinstance(item, str):  # an AbsTask built by the caller (a custom or pre-filtered task)
            out.setdefault(item.metadata.name, item)
            continue
        if item in TABLE5_TYPES:
            for name, t in bench.items():
                if t.metadata.type == item and name not in out:
                    out[name] = copy.deepcopy(t)  # our own object: loading/unloading its data touches no one else's
        elif item in bench:
            if item not in out:
                out[item] = copy.deepcopy(bench[item])
        else:
            try:
                out.setdefault(item, mteb.get_task(item))
            except KeyError:
                unknown.append(item)
    if unknown:
        registry = task_names()
        lower = {n.lower(): n for n in registry}
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, registry, n=5, cutoff=0.6)
            close += [lower[name.lower()]] if name.lower() in lower and lower[name.lower()] not in close else []
            close += [n for n in registry if name.lower() in n.lower() and n not in close][: 5 - len(close)]
            hints.append(f"'{name}' (close: {', '.join(close) if close else 'none'})")
        raise MTEBTaskError(
            f"{where}: unknown MTEB task(s) {'; '.join(hints)}; a task type ({', '.join(TABLE5_TYPES)}) "
            f"names all its tasks of {BENCHMARK}; list them all with "
            "`python -c \"import mteb; print([t.metadata.name for t in mteb.get_tasks()])\"`"
        )
    return list(out.values())


def _leaf_tasks(tasks: Iterable[AbsTask]) -> list[AbsTask]:
    """An aggregate task (CQADupstackRetrieval) loads and scores its sub-tasks."""
    from mteb.abstasks.aggregated_task import AbsTaskAggregate

    out: list[AbsTask] = []
    for t in tasks:
        out += _leaf_tasks(t.metadata.tasks) if isinstance(t, AbsTaskAggregate) else [t]
    return out


def _fetch_hint(names: Sequence[str]) -> str:
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE)
    hub, cache = constants.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE
    fetch = "; ".join(f"mteb.get_task('{n}').load_data()" for n in names)
    them = "it" if len(names) == 1 else "them"
    return (
        f"{'offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE) and ' if offline else ''}"
        f"the local Hugging Face cache (HF_HOME {os.environ.get('HF_HOME', constants.HF_HOME)}: hub {hub}, "
        f"datasets {cache}) lacks {them}. Fetch {them} on a machine with network: "
        f"`HF_HOME=/tmp/mteb-hf python -c \"import mteb; {fetch}\"`, "
        f"then copy /tmp/mteb-hf/hub/* into {hub}/ and /tmp/mteb-hf/datasets/* into {cache}/ here"
    )


def load_task_data(tasks: Sequence[AbsTask]) -> None:
    """Load every task's data set now (before any encoding); those that cannot be loaded raise one
    :class:`MTEBDataMissing` naming each task, its HF data set id and revision, and the fix."""
    missing: list[tuple[AbsTask, BaseException]] = []
    for task in _leaf_tasks(tasks):
        if task.data_loaded:
            continue
        try:
            task.load_data()
        except Exception as err:  # datasets: ConnectionError (offline), FileNotFoundError, DatasetNotFoundError...
            missing.append((task, err))
    if missing:
        listed = "; ".join(
            f"{t.metadata.name}: {t.metadata.dataset.get('path')} (revision {t.metadata.dataset.get('revision')}; "
            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
            for t, e in missing
        )
        raise MTEBDataMissing(
            f"MTEB data set(s) not available: {listed}. "
            + _fetch_hint([t.metadata.name for t, _ in missing])
        ) from missing[0][1]


def prepare_tasks(tasks: Sequence[str | AbsTask], where: str = "mteb") -> list[AbsTask]:
    """:func:`resolve_tasks` then :func:`load_task_data`: call it before building the encoder so a
    bad name or an uncached data set costs no model load."""
    resolved = resolve_tasks(tasks, where)
    load_task_data(resolved)
    return resolved


def mteb_model_name(model_name: str) -> str:
    """mteb names models "org/name"; the name only labels results (and their folder under
    ``results/``): the last two parts of a path or HF id, "mmcse/<name>" for one part, unsafe
    characters -> "-"."""
    parts = [p for p in re.split(r"[/\\]", model_name) if p not in ("", ".", "..")] or ["model"]
    name = "/".join(parts[-2:]) if len(parts) >= 2 else f"mmcse/{parts[0]}"
    return re.sub(r"[^A-Za-z0-9._/-]", "-", name)


def model_revision(location: str | Path) -> str | None:
    """The revision mteb files a model's results under (``results/<model>/<revision>/``): for a
    checkpoint mmcse trained, the first 12 hex digits of its seal's ``config_hash`` (the configuration
    and code that trained it, `mmcse.training.checkpoints.run_definition_hash`: a retrained model with
    other settings gets another folder); for a Hugging Face cache snapshot, its commit; else None
    (mteb's ``no_revision_available``)."""
    folder = Path(location)
    if not folder.is_dir():
        return None
    sealed = read_seal(folder, "retrain it (dvc repro train)")
    if sealed is not None and sealed.get("config_hash"):
        return str(sealed["config_hash"])[:12]
    return folder.name if folder.parent.name == "snapshots" else None


def encoder_details(encoder: TextEncoder, location: str | Path) -> dict[str, Any]:
    """What mteb's ``model_meta.json`` records of ``encoder`` loaded from ``location`` (`model_revision`,
    parameters, token limit); the evaluate stage adds the language and base model it trained from."""
    return {"revision": model_revision(location), "max_tokens": encoder.max_length,
            "n_parameters": int(sum(p.numel() for p in encoder.model.parameters()))}


def _model_meta(model_name: str, **details: Any) -> Any:
    from mteb.models.model_meta import ModelMeta, ScoringFunction

    # create_empty's overwrites skip pydantic's validators: the enum itself, not "cosine"
    return ModelMeta.create_empty({"name": mteb_model_name(model_name), "similarity_fn_name": ScoringFunction.COSINE,
                                   "framework": ["Sentence Transformers", "PyTorch"], "modalities": ["text"],
                                   **{k: v for k, v in details.items() if v is not None}})


def results_readme(model_name: str, details: dict[str, Any], task_names: Sequence[str], cache_path: str,
                   why_none: str | None = None) -> str:
    """The README of an MTEB results folder: what is in it and how mteb's own loader reads it
    (``why_none``: why no task ran, default: ``evaluate.mteb`` is empty, with how to name some)."""
    name = mteb_model_name(model_name)
    revision = details.get("revision") or "no_revision_available"
    if not task_names:
        return (f"# MTEB results of {name}\n\nNo MTEB task ran for this model: " + (why_none or (
                "`evaluate.mteb` is empty. Name tasks or task types there (e.g. `evaluate.mteb: [SciDocsRR, "
                "STS17]`, or DALR Table 5's `[Reranking, Classification, Retrieval, STS]`) and rerun the evaluate "
                "stage; each task's result then lands here in mteb's own layout")) + ".\n")
    listed = ", ".join(f"`{t}`" for t in task_names)
    return (f"# MTEB results of {name}\n\n"
            f"mteb's own layout, as `mteb.evaluate` writes it: `results/{name.replace('/', '__')}/{revision}/` "
            f"holds one `<Task>.json` per task ({listed}), `model_meta.json` and `run_settings.jsonl`. mteb's "
            "tooling reads it without conversion:\n\n```python\nimport mteb\n\n"
            f"results = mteb.ResultCache(cache_path=\"{cache_path}\").load_results(\n"
            f"    models=[\"{name}\"], include_remote=False)\n"
            "print(results.to_dataframe())\n```\n")


def encoder_for_mteb(encode: EncodeFn, model_name: str, batch_size: int, details: dict[str, Any] | None = None) -> Any:
    """``encode`` as an mteb 2.x ``EncoderProtocol`` model (an ``AbsEncoder``), for ``mteb.evaluate``."""
    from mteb.models.abs_encoder import AbsEncoder

    class EncodeFnModel(AbsEncoder):
        """mteb's ``EncoderProtocol`` over an mmcse ``EncodeFn`` (list of sentences -> [n, dim]
        array). Texts are gathered from mteb's data loader, each distinct text encoded once in
        batches of similar length (mmcse's ``encode_unique``: the batches ``mmcse eval`` encodes),
        and returned in mteb's order; no prompts (mmcse students have none); similarity: cosine."""

        def __init__(self) -> None:
            self.model = encode
            self.mteb_model_meta = _model_meta(model_name, **(details or {}))
            self.batch_size = batch_size

        def encode(self, inputs: Any, *, task_metadata: Any, hf_split: str, hf_subset: str,
                   prompt_type: Any = None, **kwargs: Any) -> np.ndarray:
            texts: list[str] = [t for batch in inputs for t in batch["text"]]
            if not texts:
                return np.zeros((0, 0), dtype=np.float32)
            vectors = encode_unique(self.model, texts, self.batch_size, desc=f"encode {task_metadata.name}")
            return np.stack([vectors[t] for t in texts]).astype(np.float32)  # [n, dim]

    return EncodeFnModel()


@contextlib.contextmanager
def results_folder(folder: Path | None, model_name: str, details: dict[str, Any], task_names: Sequence[str],
                   why_none: str | None = None) -> Iterator[Path | None]:
    """Yield where ``mteb_scores`` should write (``output_dir``): a fresh folder beside ``folder``
    that, once the block finishes, gets its README (`results_readme`) and replaces ``folder`` whole,
    so a results folder never mixes two evaluations; an error leaves the old one. With no
    ``task_names`` the folder holds only the README saying so (a DVC output always exists).
    ``folder`` None: yields None, nothing is written."""
    if folder is None:
        yield None
        return
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.*"):  # builds a killed evaluation left (no finally ran)
        shutil.rmtree(stale, ignore_errors=True)
    build = build_dir(folder.parent, f".{folder.name}.")
    try:
        yield build
        shown, cwd = folder.resolve(), Path.cwd().resolve()
        shown = shown.relative_to(cwd) if shown.is_relative_to(cwd) else shown  # the README's load snippet
        write_text(build / "README.md", results_readme(model_name, details, task_names, shown.as_posix(), why_none))
        swap_in_dir(build, folder)
    finally:
        if build.exists():
            shutil.rmtree(build)


def mteb_scores(
    encode: EncodeFn,
    model_name: str,
    tasks: Sequence[str | AbsTask],
    batch_size: int = 128,
    output_dir: Path | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Run MTEB ``tasks`` (names, task types of Table 5, or task objects) on ``encode``.

    Returns ``mteb_<Task>`` (main score x 100), ``mteb_type_<Type>`` (mean per task type) and
    ``mteb_avg`` (PRIMARY: mean over the tasks). ``output_dir``: mteb's result JSONs go to
    ``<output_dir>/results/<model>/<revision>/`` (mteb's layout, read back by ``mteb.ResultCache``; always
    recomputed), the model described by ``details`` (`encoder_details`: ``model_meta.json``'s revision,
    sizes, languages...); none: nothing is written. Names are checked and all data loaded before anything is encoded."""
    import mteb

    if batch_size < 1:
        raise ValueError(f"mteb: batch_size must be >= 1, got {batch_size}")
    resolved = prepare_tasks(tasks)
    details = dict(details or {})
    if output_dir is not None:  # model_meta.json's embedding size: one sentence encoded, only for the file
        details.setdefault("embed_dim", int(np.asarray(encode(["."])).shape[-1]))
    model = encoder_for_mteb(encode, model_name, batch_size, details)
    cache = mteb.ResultCache(cache_path=output_dir) if output_dir is not None else None
    scores: dict[str, float] = {}
    by_type: dict[str, list[float]] = {}
    for task in resolved:
        result = mteb.evaluate(model, task, cache=cache, overwrite_strategy="always", show_progress_bar=False,
                               co2_tracker=False,
                               encode_kwargs={"batch_size": batch_size, "show_progress_bar": False})
        if result.exceptions:
            raise RuntimeError(f"MTEB task {task.metadata.name} failed: {result.exceptions[0].exception}")
        (task_result,) = result.task_results
        name = task.metadata.name
        # main score of every evaluated split and subset, averaged (one split for the benchmark's tasks)
        scores[f"mteb_{name}"] = float(task_result.get_score()) * 100.0
        by_type.setdefault(task.metadata.type, []).append(scores[f"mteb_{name}"])
        for leaf in _leaf_tasks([task]):
            leaf.unload_data()
    for kind, values in by_type.items():
        scores[f"mteb_type_{kind}"] = float(np.mean(values))
    scores[PRIMARY_METRIC] = float(np.mean([v for k, v in scores.items() if not k.startswith("mteb_type_")]))
    return scores
