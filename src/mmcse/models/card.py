"""A model card (``README.md``) for a trained sentence encoder's folder, as sentence-transformers and
the Hugging Face Hub expect one: YAML metadata (``library_name``, ``pipeline_tag``, ``tags``,
``base_model``, ``datasets`` and a ``model-index`` of the evaluated scores, written by huggingface_hub's
own `ModelCardData`), then the method with its paper's citation, the configuration it was trained
with (the resolved params, the mmcse commit, the environment), the scores table and how to load it.
The license is left to the person who publishes it.

The evaluate stage writes it into ``models/student/best`` (a file DVC ignores inside the train stage's
output: ``.dvcignore``) whenever it scores a model, and into the MLflow model it logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mmcse.config import Config, to_dict
from mmcse.config.readings import READING_POINTS, encoder_of, reading_summary, row_reading
from mmcse.data.senteval import STS_TASKS, TRANSFER_TASKS
from mmcse.environment import describe
from mmcse.integrity.code import TRAINING_CODE, code_digest, code_files, source_state
from mmcse.io import tracked, write_text

CARD = "README.md"

# The method's paper: (what it is, BibTeX). Venues only where the paper says where it appeared.
PAPERS: dict[str, tuple[str, str]] = {
    "simcse": ("SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao, Yao and Chen, EMNLP 2021)",
               "@inproceedings{gao2021simcse,\n  title = {{SimCSE}: Simple Contrastive Learning of Sentence "
               "Embeddings},\n  author = {Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},\n  booktitle = "
               "{Proceedings of EMNLP},\n  year = {2021}\n}"),
    "mcse": ("MCSE: Multimodal Contrastive Learning of Sentence Embeddings (Zhang et al., NAACL 2022)",
             "@inproceedings{zhang2022mcse,\n  title = {{MCSE}: Multimodal Contrastive Learning of Sentence "
             "Embeddings},\n  author = {Zhang, Miaoran and Mosbach, Marius and Adelani, David Ifeoluwa and Hedderich, "
             "Michael A. and Klakow, Dietrich},\n  booktitle = {Proceedings of NAACL},\n  year = {2022}\n}"),
    "kdmcse": ("KDMCSE: Knowledge Distillation Multimodal Sentence Embeddings with Adaptive Angular margin "
               "Contrastive Learning (Nguyen, Nguyen, Wu and Luu)",
               "@inproceedings{nguyen2024kdmcse,\n  title = {{KDMCSE}: Knowledge Distillation Multimodal Sentence "
               "Embeddings with Adaptive Angular margin Contrastive Learning},\n  author = {Nguyen, Cong-Duy and "
               "Nguyen, Thong and Wu, Xiaobao and Luu, Anh Tuan},\n  year = {2024}\n}"),
    "dalr": ("DALR: Dual-level Alignment Learning for Multimodal Sentence Representation Learning "
             "(He, Ding, Wang, Li, Teng and Ji)",
             "@inproceedings{he2025dalr,\n  title = {{DALR}: Dual-level Alignment Learning for Multimodal Sentence "
             "Representation Learning},\n  author = {He, Kang and Ding, Yuzhe and Wang, Haining and Li, Fei and "
             "Teng, Chong and Ji, Donghong},\n  year = {2025}\n}"),
    "mcseo": ("Improving Multimodal Contrastive Learning of Sentence Embeddings with Object-Phrase Alignment "
              "(MCSEO; Zhao, Miao and Tsuruoka)",
              "@misc{zhao-mcseo,\n  title = {Improving Multimodal Contrastive Learning of Sentence Embeddings "
              "with Object-Phrase Alignment},\n  author = {Zhao, Kaiyan and Miao, Zhongtao and Tsuruoka, "
              "Yoshimasa}\n}"),
}

# data.pairs / data.corpus → the Hub dataset a card names (the sources mmcse reads them from)
HUB_DATASETS = {"flickr30k": "nlphuji/flickr30k", "wiki1m": "princeton-nlp/datasets-for-simcse"}


def _eval_results(scores: dict[str, float]) -> list[Any]:
    """The model-index entries: each STS task's Spearman (×100, cosine) and each transfer task's accuracy."""
    from huggingface_hub import EvalResult

    results = []
    for task in STS_TASKS:
        if task in scores:
            results.append(EvalResult(task_type="sentence-similarity", task_name="Semantic Textual Similarity",
                                      dataset_type=f"senteval/{task}", dataset_name=task, dataset_split="test",
                                      metric_type="spearman_cosine", metric_name="Spearman (cosine) ×100",
                                      metric_value=float(scores[task])))
    for task in TRANSFER_TASKS:
        if task in scores:
            results.append(EvalResult(task_type="text-classification", task_name="SentEval transfer",
                                      dataset_type=f"senteval/{task}", dataset_name=task,
                                      metric_type="accuracy", metric_name="Accuracy ×100",
                                      metric_value=float(scores[task])))
    if not results and "avg" in scores:  # the demo's one STS set: its score is the average
        results.append(EvalResult(task_type="sentence-similarity", task_name="Semantic Textual Similarity",
                                  dataset_type="mmcse/demo-sts", dataset_name="mmcse demo STS", dataset_split="test",
                                  metric_type="spearman_cosine", metric_name="Spearman (cosine) ×100",
                                  metric_value=float(scores["avg"])))
    return results


# What a score's number is, by the end of its name (the first that matches): its measure and its range.
SCALES: tuple[tuple[str, str], ...] = (
    ("_rsum", "sum of the six R@K, 0–600"),
    ("_R1", "recall@1: % of queries whose match ranks first, 0–100"),
    ("_R5", "recall@5: % of queries with a match in the top 5, 0–100"),
    ("_R10", "recall@10: % of queries with a match in the top 10, 0–100"),
    ("alignment", "mean squared distance of positive pairs' unit vectors, 0–4, lower is closer"),
    ("uniformity", "log of the mean Gaussian potential of all pairs, ≤ 0, lower is more uniform"),
    ("silhouette", "silhouette of the t-SNE map's clusters, −1–1"),
    ("transfer_avg", "mean accuracy of the transfer tasks ×100"),
)


def score_scale(name: str) -> str:
    """The measure and range of the score ``name`` (`SCALES`; NDCG, STS and transfer tasks by their names)."""
    if "NDCG" in name:
        return "graded NDCG@K of the ranking, 0–1"
    if name == "avg":
        return "the headline: mean of the STS test sets' Spearman correlations of cosine similarities ×100, −100–100"
    if name in STS_TASKS:
        return "Spearman's correlation of cosine similarities ×100, −100–100"
    if name in TRANSFER_TASKS:
        return "accuracy ×100"
    return next((scale for end, scale in SCALES if name.endswith(end)), "")


LOWER_IS_BETTER = ("alignment", "uniformity")  # geometry scores (Wang & Isola 2020): lower is closer / more uniform


def worse_than_untrained(name: str, value: float, untrained: dict[str, float]) -> str:
    """A word for a geometry score that moved the wrong way in training (above the untrained encoder's, where lower
    is better): a reader of the card should not take 0.26 → 0.51 for progress."""
    before = untrained.get(name)
    if not name.endswith(LOWER_IS_BETTER) or not isinstance(before, (int, float)) or value <= before:
        return ""
    return f"; **worse than untrained** ({before} → {value})"


def data_statement(cfg: Config) -> str:
    """The card's first word on data: what the model saw and was scored on; the demo's generated sets say so."""
    if cfg.data.pairs == "demo" and cfg.data.source == "demo":
        return ("**Data: generated, not a benchmark.** Trained and scored on mmcse's demo world: images of generated "
                "scenes with template captions, a generated text corpus and generated STS pairs (the download "
                "stage writes them). Its scores show the pipeline ran end to end; they say nothing about Flickr30k, "
                "COCO or SentEval, and no benchmark result is claimed.")
    pairs = "no image–caption pairs" if cfg.data.pairs == "none" else f"{cfg.data.pairs} image–caption pairs"
    corpus = f", the {cfg.data.corpus} text corpus" if cfg.data.corpus != "demo" else ", the generated text corpus"
    sts = "SentEval's STS sets" if cfg.data.source == "senteval" else "the generated demo STS pairs"
    return f"**Data**: trained on {pairs}{corpus}; STS scored on {sts}."


def recipe_rows(cfg: Config) -> list[str]:
    """The recipe in a short table: method, start, teachers, data, steps, the points where paper and code differ."""
    t, joint = cfg.teachers, cfg.teachers.joint
    poolers: dict[str, list[str]] = {}  # one entry per distinct teacher model, its poolers and weights inside
    for x in t.text:
        poolers.setdefault(x.teacher, []).append(f"{x.pooler} ×{x.weight}")
    text = "; ".join(f"{teacher} ({', '.join(ways)})" for teacher, ways in poolers.items()) or "none"
    method = cfg.train.method
    own = {p.key: value for p in READING_POINTS if p.paper == method
           for value in [_setting(cfg, p.key)]}
    rows = [("method", f"{method} ({PAPERS.get(method, (method, ''))[0]})"),
            ("starts from", f"`{cfg.model.name_or_path}` ({cfg.model.init})"),
            ("teachers", f"image {t.image_encoder}; joint {joint.kind}"
                         f"{'' if joint.kind == 'cca' else ' ' + joint.model}; text {text}"),
            ("data", f"pairs {cfg.data.pairs}, corpus {cfg.data.corpus}, STS {cfg.data.source}"),
            ("steps", f"{cfg.train.epochs} epoch(s), at most {cfg.train.max_steps or 'all'} steps, batch "
                      f"{cfg.train.batch_size}, learning rate {cfg.train.learning_rate}, {cfg.train.precision}, "
                      f"seed {cfg.base.seed}"),
            ("paper or code", reading_summary(row_reading(own, encoder_of(cfg.model.name_or_path))))]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _setting(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def model_card(cfg: Config, scores: dict[str, float], environment: dict[str, str], commit: str,
               model_name: str = "mmcse sentence encoder", changed: Sequence[str] = (), code: str = "",
               chance: dict[str, float] | None = None, untrained: dict[str, float] | None = None) -> str:
    """The card's text for a model trained with ``cfg`` and scored ``scores`` (bare score names, as
    `mmcse.pipeline.evaluate.run_evaluate` returns them) in ``environment`` (`mmcse.environment.environment`);
    ``chance``: what a random ranking scores on the same retrieval sets (`mmcse.evaluation.retrieval.
    chance_metrics`), shown beside R@K; ``untrained``: the scores of the encoder training started from on the
    same sets (`mmcse.pipeline.evaluate.untrained_scores`)."""
    from huggingface_hub import ModelCardData

    scores = tracked(dict(scores))  # the precision metrics/eval.json keeps: the card says the same numbers
    method = cfg.train.method
    title, bibtex = PAPERS.get(method, (method, ""))
    base = cfg.model.name_or_path
    hub_base = None if base.startswith("packaged:") or Path(base).exists() else base
    datasets = [HUB_DATASETS[d] for d in (cfg.data.pairs, cfg.data.corpus) if d in HUB_DATASETS]
    data = ModelCardData(
        library_name="sentence-transformers", pipeline_tag="sentence-similarity",
        tags=["sentence-transformers", "sentence-similarity", "feature-extraction", "mmcse", method],
        base_model=hub_base, datasets=datasets or None, model_name=model_name,
        eval_results=_eval_results(scores) or None)
    resolved = {k: v for k, v in to_dict(cfg).items() if k not in ("ablate", "sweep")}
    chance, untrained = tracked(dict(chance or {})), tracked(dict(untrained or {}))
    rows = "\n".join(f"| {name} | {value} | {score_scale(name)}{worse_than_untrained(name, value, untrained)} | "
                     f"{untrained.get(name, '')} | {chance.get(name, '')} |" for name, value in sorted(scores.items()))
    return "\n".join([
        "---", data.to_yaml(), "---", "",
        f"# {model_name}", "",
        data_statement(cfg), "",
        f"A sentence encoder trained with **{method}** by mmcse: {title}. It starts from `{base}` and encodes a "
        f"sentence into one vector (pooler `{cfg.evaluate.pooler}`, as it was scored).", "",
        "## Scores", "",
        "The evaluate stage's scores (`metrics/eval.json`, keyed `test_<name>` there; the dev geometry `dev_<name>`), "
        "each with its scale. "
        "Retrieval (`<set>_i2t_*`: an image's captions among all captions; `<set>_t2i_*`: a caption's image among all "
        "images) is beside what a random ranking scores on the same set in expectation (chance). *Untrained*: the "
        f"encoder training started from (`{base}`, the method's heads as initialised) on the same sets.", "",
        "| score | value | scale | untrained | chance |", "|---|---|---|---|---|", rows, "",
        "## Recipe", "",
        *recipe_rows(cfg), "",
        "**License**: not set. Add a `license:` to the metadata above before publishing, compatible with the "
        f"licenses of `{base}` and of the training data.", "",
        "## Use", "",
        "```python", "from sentence_transformers import SentenceTransformer", "",
        'model = SentenceTransformer("path/to/this/folder")',
        'embeddings = model.encode(["A dog runs on the beach.", "A puppy plays in the sand."])',
        "print(model.similarity(embeddings, embeddings))", "```", "",
        "## Training", "",
        f"- mmcse commit: `{commit}`" + (f", **with uncommitted changes in** {', '.join(changed)}" if changed else ""),
        *([f"- training code digest: `{code}`"] if code else []),
        f"- environment: {describe(environment)}",
        f"- seed {cfg.base.seed}, {cfg.train.epochs} epoch(s) (max_steps {cfg.train.max_steps}), batch "
        f"{cfg.train.batch_size}, learning rate {cfg.train.learning_rate}, precision {cfg.train.precision}", "",
        "<details><summary>The resolved configuration (params.yaml after profile and recipe)</summary>", "",
        "```yaml", yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True).rstrip(), "```", "", "</details>", "",
        "## Citation", "",
        *(["```bibtex", bibtex, "```", ""] if bibtex else []),
    ])


def write_model_card(folder: str | Path, cfg: Config, scores: dict[str, float], environment: dict[str, str],
                     commit: str | None = None, chance: dict[str, float] | None = None,
                     untrained: dict[str, float] | None = None) -> Path:
    """``folder/README.md`` (`model_card`), written atomically; returns its path. Without ``commit`` the card
    names the checkout's commit, any uncommitted change to its code (`source_state`: a model made from a dirty
    tree is not its commit's model) and the digest of the training code."""
    path = Path(folder) / CARD
    changed: list[str] = []
    code = ""
    if commit is None:
        state = source_state()
        commit, changed = state["commit"], state["changed"]
        code = code_digest(code_files(TRAINING_CODE))[:16]
    write_text(path, model_card(cfg, scores, environment, commit, changed=changed, code=code, chance=chance,
                                untrained=untrained))
    return path
