"""A model folder as a sentence-transformers folder that pools the way ``mmcse eval`` does.

``export_sentence_transformers(folder, pooler)`` writes ``modules.json``,
``sentence_bert_config.json``, ``config_sentence_transformers.json`` and one sub-folder per
module into an HF model folder (an mmcse student checkpoint, or any BERT-style encoder), so
``SentenceTransformer(folder).encode(sentences)`` returns the vectors that
:class:`mmcse.evaluation.sts.TextEncoder` computes with that pooler (fp32):

- the HF files stay as they are; ST's ``Transformer`` reads them from the folder's root;
- ``cls_before_pooler``: ``Pooling("cls")`` (the first token: [CLS] with right padding);
- ``cls``: ``Pooling("cls")`` then ``Dense`` + Tanh holding the student's MLP (``heads.safetensors``)
  or, for a plain HF encoder, its BERT pooler, which ``TextEncoder`` takes as ``pooler_output``;
- ``avg``: ``Pooling("mean")``, the masked mean of the last layer;
- ``avg_first_last`` / ``avg_top2`` / ``avg_embeddings_last``: ``WeightedLayerPooling`` with weight 1 on the
  two layers of :func:`mmcse.models.student.pool` (hidden_states[1], [-2] or [0], and [-1]) and 0 elsewhere, giving
  their token-wise mean, then ``Pooling("mean")``; the hidden states come from
  ``config_kwargs.output_hidden_states`` in ``sentence_bert_config.json``.

Only classes of the ``sentence_transformers`` package are referenced, so loading needs no
``trust_remote_code``. Inputs are cut at ``min(max_seq_len, tokenizer.model_max_length)`` tokens,
as ``TextEncoder`` cuts them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import mlflow
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mmcse.config import POOLERS
from mmcse.errors import InputError
from mmcse.integrity.files import check_sealed, seal_folder
from mmcse.io import build_dir, write_json
from mmcse.models.student import HEADS_FILE, HEADS_META

# `mmcse eval --max-seq-len` and the evaluate stage's TextEncoder default: the length the reported
# STS scores were encoded at (training's dev evaluation uses model.max_seq_len instead).
EVAL_MAX_SEQ_LEN = 512

_TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
_LAYERS = "sentence_transformers.sentence_transformer.modules.weighted_layer_pooling.WeightedLayerPooling"
_DENSE = "sentence_transformers.base.modules.dense.Dense"
# BERT-family encoders whose HF pooler is dense + tanh over the first token (TextEncoder's `cls`
# of a plain HF model reads that pooler_output)
_TANH_POOLER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
LAYER_POOLERS = ("avg_first_last", "avg_top2", "avg_embeddings_last")  # two hidden states averaged


def _hf_pooler_weights(folder: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The saved HF pooler's (weight (H, H), bias (H,)) of a plain encoder folder, if it has them."""

    files = sorted(folder.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.endswith(("pooler.dense.weight", "pooler.dense.bias")):
                    found[key.rsplit(".", 1)[1]] = f.get_tensor(key)
    if not files and (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        found = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.endswith(("pooler.dense.weight",
                                                                                   "pooler.dense.bias"))}
    if set(found) != {"weight", "bias"}:
        return None
    return found["weight"], found["bias"]


def _mlp_weights(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's SimCSE MLP (``Student.mlp``: Linear(H, H) + Tanh) from heads.safetensors."""

    heads = load_file(str(folder / HEADS_FILE))
    try:
        return heads["mlp.dense.weight"], heads["mlp.dense.bias"]
    except KeyError as err:
        raise InputError(f"{folder / HEADS_FILE}: no {err.args[0]} (the student's MLP pooler)") from None


def _save_module(module: torch.nn.Module, folder: Path, name: str) -> None:
    """``module.save`` into a fresh folder beside ``folder / name``, then renamed over it."""
    target = folder / name
    tmp = build_dir(folder, prefix=f".{name}.", suffix=".tmp")
    try:
        module.save(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _old_module_dirs(folder: Path) -> set[str]:
    """Module sub-folders a previous modules.json names (a re-export replaces them)."""
    try:
        entries = json.loads((folder / "modules.json").read_text())
        paths = {str(e["path"]) for e in entries}
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return set()
    return {p for p in paths if p and "/" not in p and "\\" not in p and not p.startswith(".")}


def export_sentence_transformers(
    model_folder: str | Path, pooler: str, max_seq_len: int = EVAL_MAX_SEQ_LEN,
) -> Path:
    """Make ``model_folder`` (an HF encoder folder or mmcse student checkpoint) loadable by
    ``SentenceTransformer(model_folder)`` with ``pooler``'s computation; returns the folder.

    Raises ValueError for an unknown pooler, a non-positive ``max_seq_len``, or ``cls`` on a folder
    without the student's heads and without a BERT-style saved pooler; FileNotFoundError for a
    folder without config.json."""
    from sentence_transformers import __version__ as st_version
    from sentence_transformers.base.modules import Dense
    from sentence_transformers.sentence_transformer.modules import Pooling, WeightedLayerPooling
    from transformers import AutoConfig, AutoTokenizer
    from transformers import __version__ as hf_version

    folder = Path(model_folder)
    if pooler not in POOLERS:
        raise InputError(f"unknown pooler {pooler!r}; poolers: {', '.join(POOLERS)}")
    if max_seq_len < 1:
        raise InputError(f"max_seq_len must be positive, got {max_seq_len}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a model folder (no config.json)")
    # a sealed checkpoint (`mmcse.integrity.files.SEAL`) is checked first and sealed again afterwards
    sealed = check_sealed(folder, "retrain it (dvc repro train)")
    student = (folder / HEADS_META).is_file()
    config = AutoConfig.from_pretrained(folder)
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)

    dense: tuple[torch.Tensor, torch.Tensor] | None = None
    if pooler == "cls":
        if student:
            dense = _mlp_weights(folder)
        else:
            dense = _hf_pooler_weights(folder) if config.model_type in _TANH_POOLER_TYPES else None
            if dense is None:
                raise InputError(
                    f"{folder}: pooler 'cls' needs the student's MLP ({HEADS_META} + heads.safetensors) or a saved "
                    "BERT-style pooler (pooler.dense.*); this folder has neither: export with cls_before_pooler or avg"
                )
    # TextEncoder's length: the requested one, capped by the tokenizer's model_max_length
    tokenizer = AutoTokenizer.from_pretrained(folder)
    length = min(max_seq_len, getattr(tokenizer, "model_max_length", max_seq_len) or max_seq_len)

    modules: list[tuple[str, object | None]] = [(_TRANSFORMER, None)]
    if pooler in LAYER_POOLERS:
        # mmcse.models.student.pool: masked_mean((hidden_states[a] + hidden_states[-1]) / 2); hidden_states has
        # layers + 1 entries (embeddings first), a = 1 (first layer), 0 (embeddings) or layers - 1 (second to last)
        first = {"avg_first_last": 1, "avg_embeddings_last": 0}.get(pooler, layers - 1)
        weights = torch.tensor([1.0 if i in (first, layers) else 0.0 for i in range(first, layers + 1)])
        modules.append((_LAYERS, WeightedLayerPooling(hidden, num_hidden_layers=layers, layer_start=first,
                                                      layer_weights=torch.nn.Parameter(weights))))
    mode = "cls" if pooler in ("cls", "cls_before_pooler") else "mean"
    modules.append((_POOLING, Pooling(hidden, pooling_mode=mode)))
    if dense is not None:
        weight, bias = dense  # (H, H), (H,): SimCSE's MLP / BERT's pooler, dense then tanh
        modules.append((_DENSE, Dense(hidden, hidden, bias=True, activation_function=torch.nn.Tanh(),
                                      init_weight=weight.float().clone(), init_bias=bias.float().clone())))

    stale = _old_module_dirs(folder)
    entries = []
    for idx, (type_ref, module) in enumerate(modules):
        path = "" if module is None else f"{idx}_{type_ref.rsplit('.', 1)[1]}"
        if module is not None:
            _save_module(module, folder, path)
        entries.append({"idx": idx, "name": str(idx), "path": path, "type": type_ref})

    bert_config: dict[str, object] = {"max_seq_length": length, "do_lower_case": False}
    if pooler in LAYER_POOLERS:
        bert_config["config_kwargs"] = {"output_hidden_states": True}
    if student:  # load_student reads the backbone without its (never trained, unsaved) HF pooler
        bert_config["model_kwargs"] = {"add_pooling_layer": False}
    write_json(folder / "sentence_bert_config.json", bert_config)
    write_json(folder / "config_sentence_transformers.json", {
        "__version__": {"sentence_transformers": st_version, "transformers": hf_version, "pytorch": torch.__version__},
        "model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
        "similarity_fn_name": "cosine", "mmcse_pooler": pooler,
    })
    write_json(folder / "modules.json", entries)  # last: the folder names only modules already written
    for name in stale - {e["path"] for e in entries}:
        if (folder / name).is_dir():
            shutil.rmtree(folder / name)
    if sealed is not None:
        seal_folder(folder, **{k: v for k, v in sealed.items() if k != "files"})
    return folder


MLFLOW_MODEL_NAME = "student"  # the name the train stage's run shows under "Logged models"


def log_mlflow_model(folder: str | Path, input_example: list[str], name: str = MLFLOW_MODEL_NAME) -> str:
    """A sentence-transformers folder (a best checkpoint, exported with the pooler its scores were
    computed with) as an MLflow model of the active run, in MLflow's ``sentence_transformers``
    flavour: the run's "Logged models" lists it, it can be registered, and
    ``mlflow.sentence_transformers.load_model(uri)`` (or ``mlflow.pyfunc.load_model``) encodes as the
    evaluation did. ``input_example``: sentences that become its example and signature. Its
    requirements are the installed sentence-transformers, transformers and torch (pinned here:
    MLflow's inference would import and scan the environment). Returns the model's URI."""

    from sentence_transformers import SentenceTransformer

    folder = Path(folder)
    if not (folder / "modules.json").is_file():
        raise FileNotFoundError(f"{folder}: not a sentence-transformers folder (no modules.json); export it first "
                                "(mmcse export)")
    pooler = json.loads((folder / "config_sentence_transformers.json").read_text()).get("mmcse_pooler")
    model = SentenceTransformer(str(folder), device="cpu")
    requirements = [f"{p}=={importlib.metadata.version(p)}" for p in ("sentence-transformers", "transformers", "torch")]
    info = mlflow.sentence_transformers.log_model(model, name=name, input_example=list(input_example),
                                                  pip_requirements=requirements,
                                                  metadata={"mmcse_pooler": pooler, "checkpoint": str(folder)})
    return info.model_uri
