"""The student sentence encoder, its training heads, and SimCSE's poolers."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mmcse.config import POOLERS, ModelConfig
from mmcse.errors import InputError
from mmcse.hub import resolve_model

log = logging.getLogger(__name__)

HEADS_FILE = "heads.safetensors"
HEADS_META = "heads.json"


# The truncation / padding state of each fast tokenizer's backend as it was loaded or built: every
# call with ``truncation=True, max_length=…`` or ``padding=…`` overwrites that state, and
# ``save_pretrained`` writes whatever the last call left (`save_tokenizer` writes this one instead).
_LOADED_STATE: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def remember_loaded_state(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Note the backend's truncation and padding as they are now (right after loading or building)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        _LOADED_STATE[tokenizer] = (backend.truncation, backend.padding)
    return tokenizer


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    return remember_loaded_state(AutoTokenizer.from_pretrained(resolve_model(name_or_path), use_fast=True))


def _set_backend_state(backend: Any, truncation: dict[str, Any] | None, padding: dict[str, Any] | None) -> None:
    if truncation is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(**truncation)
    if padding is None:
        backend.no_padding()
    else:
        backend.enable_padding(**padding)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)`` with its backend's truncation and padding as loaded
    (`remember_loaded_state`; one never noted: none), so a checkpoint's bytes do not depend on
    which tokenizer calls ran before it was saved (cached token tables or not); the tokenizer is
    left as it was."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        tokenizer.save_pretrained(folder)
        return
    now = (backend.truncation, backend.padding)
    _set_backend_state(backend, *_LOADED_STATE.get(tokenizer, (None, None)))
    try:
        tokenizer.save_pretrained(folder)
    finally:
        _set_backend_state(backend, *now)


def backbone_config(cfg: ModelConfig, dropout: float | None = None) -> tuple[str, PretrainedConfig]:
    """Where the model named by ``cfg`` is, and its HF config with ``model.config_overrides`` and
    ``dropout`` applied."""
    location = resolve_model(cfg.name_or_path)
    return location, configure(AutoConfig.from_pretrained(location), cfg, dropout)


def configure(config: PretrainedConfig, cfg: ModelConfig, dropout: float | None = None) -> PretrainedConfig:
    """``config`` (changed in place and returned) with ``model.config_overrides`` and ``dropout`` applied."""
    overrides = dict(cfg.config_overrides)
    if dropout is not None:
        overrides |= {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise InputError(
                f"params.yaml: model.config_overrides.{key} is not a field of {type(config).__name__}"
            )
        setattr(config, key, value)
    return config


def load_backbone(cfg: ModelConfig, dropout: float | None = None) -> PreTrainedModel:
    """The HF encoder named by ``cfg``: pretrained, or fresh weights from its (overridden) config."""
    location, config = backbone_config(cfg, dropout)
    if cfg.init == "pretrained":
        return AutoModel.from_pretrained(location, config=config, add_pooling_layer=False)
    return AutoModel.from_config(config, add_pooling_layer=False)


class MaskedLMHead(nn.Module):
    """The LM head of SimCSE's auxiliary MLM objective (SimCSE App. E), with what masking needs:
    the tokenizer's mask id, the number of ids a random replacement draws from and the special ids
    never masked. ``forward``: token states ``(M, H)`` to vocabulary logits ``(M, V)``."""

    def __init__(self, head: nn.Module, mask_id: int, vocab: int, special_ids: list[int]) -> None:
        super().__init__()
        self.head, self.mask_id, self.vocab = head, mask_id, vocab
        self.register_buffer("special_ids", torch.tensor(sorted(set(special_ids)), dtype=torch.long),
                             persistent=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.head(states)


def load_mlm_head(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, kind: str) -> MaskedLMHead:
    """The masked-LM head of ``cfg``'s model family (``loss.simcse.mlm_head``): ``pretrained`` takes the
    checkpoint's own head (a new one, logged, where the checkpoint has none, as sentence-transformers
    folders); ``new`` builds fresh weights (SimCSE's BertForCL). The head's decoder is its own
    parameter, not tied to the student's input embeddings (SimCSE's code ties neither)."""
    if tokenizer.mask_token_id is None:
        raise InputError(f"loss.simcse.mlm: the tokenizer of {cfg.name_or_path!r} has no mask token to train MLM with")
    location, config = backbone_config(cfg)
    if cfg.init == "pretrained" and kind == "pretrained":
        model, info = AutoModelForMaskedLM.from_pretrained(location, config=config, output_loading_info=True)
        missing = [k for k in info["missing_keys"] if not k.startswith(model.base_model_prefix + ".")]
        if missing:
            log.warning("loss.simcse.mlm: %s has no masked-LM head (%d weights missing): the head starts new",
                        cfg.name_or_path, len(missing))
    else:
        model = AutoModelForMaskedLM.from_config(config)
    heads = [m for name, m in model.named_children() if name != model.base_model_prefix]
    if len(heads) != 1:
        raise InputError(f"loss.simcse.mlm: {type(model).__name__} has no single masked-LM head module "
                         f"(found {len(heads)}); MLM trains BERT- and RoBERTa-style encoders")
    vocab = min(len(tokenizer), config.vocab_size)
    return MaskedLMHead(heads[0], tokenizer.mask_token_id, vocab, tokenizer.all_special_ids)


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)  # (B, H)


def pool(
    pooler: str,
    hidden_states: tuple[torch.Tensor, ...],
    attention_mask: torch.Tensor,
    mlp: nn.Module | None = None,
) -> torch.Tensor:
    """SimCSE's poolers over ``hidden_states`` (embeddings output first, last layer last)."""
    last = hidden_states[-1]  # (B, L, H)
    if pooler == "cls_before_pooler":
        return last[:, 0]
    if pooler == "cls":
        if mlp is None:
            raise InputError("pooler 'cls' needs the model's MLP pooler; use cls_before_pooler or avg")
        return mlp(last[:, 0])
    if pooler == "avg":
        return masked_mean(last, attention_mask)
    if pooler == "avg_first_last":
        return masked_mean((hidden_states[1] + last) / 2.0, attention_mask)
    if pooler == "avg_embeddings_last":  # SimCSE's evaluation.py as released with its paper: hidden_states[0]
        return masked_mean((hidden_states[0] + last) / 2.0, attention_mask)
    if pooler == "avg_top2":
        return masked_mean((hidden_states[-2] + last) / 2.0, attention_mask)
    raise InputError(f"unknown pooler {pooler!r}; poolers: {', '.join(POOLERS)}")


class MLPPooler(nn.Module):
    """SimCSE's training-only MLP over [CLS] (dense + tanh)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


def mlp_head(in_dim: int, out_dim: int) -> nn.Sequential:
    """A two-layer projection to a shared space (DALR's modality-specific MLPs of L_cons, §3.2; the
    paper gives neither their width nor their activation: mmcse's choice is Linear–ReLU–Linear)."""
    return nn.Sequential(nn.Linear(in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim))


PROJECTION_HEADS = ("tanh", "linear")


def projection_head(in_dim: int, out_dim: int, kind: str) -> nn.Module:
    """One projection head g_φ (``model.projection_head``).

    ``tanh``: ``Linear(in_dim, out_dim)`` then tanh. KDMCSE §4.1 'MLP Projection Heads' names four MLP
    modules g_φ1, g_φ2, g_φt, g_φv and states only their output widths (768 for text-only, 256
    shared); the authors' code (and MCSE's, whose g_φ1/g_φ2 KDMCSE keeps) builds each as one dense
    layer and a tanh, with no hidden layer, which gives the width and activation used here. DALR
    App. B says "a MLP" into 256 dimensions without width or activation and builds on KDMCSE, so its
    heads are the same. ``linear``: a single ``Linear`` (mmcse's earlier heads).
    """
    if kind == "tanh":
        return nn.Sequential(nn.Linear(in_dim, out_dim), nn.Tanh())
    if kind == "linear":
        return nn.Linear(in_dim, out_dim)
    raise InputError(f"model.projection_head: {kind!r}; choose one of {', '.join(PROJECTION_HEADS)}")


HEADS = ("mlp", "text_proj", "image_proj", "teacher_text_proj", "teacher_image_proj", "text_teacher_proj",
         "shared_text", "shared_image")


class Student(nn.Module):
    """Backbone + SimCSE MLP pooler + the training heads of every method.

    ``text_proj`` g_φ1 / g_φg (MCSE Eq. 2, KDMCSE Eq. 4) and ``image_proj`` g_φ2 (MCSE Eq. 2,
    also MCSEO's object projection) map to ``proj_dim``; ``teacher_text_proj`` g_φt and
    ``teacher_image_proj`` g_φv (KDMCSE Eq. 5–6, DALR Eq. 3) project the cached joint
    teacher features; ``text_teacher_proj`` is DALR's g_φt (Eq. 3) on the aggregated text teacher
    (SimCSE + DiffCSE, width ``text_teacher_dim``); ``shared_text`` / ``shared_image`` are DALR's
    consistency MLPs. The g_φ heads are `projection_head` of kind ``head``. Only the backbone is
    kept for evaluation; heads without a loss get no gradient.
    """

    def __init__(self, backbone: PreTrainedModel, image_dim: int, proj_dim: int, joint_dim: int = 0,
                 text_teacher_dim: int = 0, head: str = "tanh", joint_text_dim: int = 0) -> None:
        super().__init__()
        hidden = backbone.config.hidden_size
        self.backbone = backbone
        self.mlp = MLPPooler(hidden)
        joint = joint_dim or image_dim  # v̂'s width
        joint_text = joint_text_dim or joint  # t̂'s: another than v̂'s with an image-only teacher's v̂
        self.text_proj = projection_head(hidden, proj_dim, head)
        self.image_proj = projection_head(image_dim, proj_dim, head)
        self.teacher_text_proj = projection_head(joint_text, proj_dim, head)
        self.teacher_image_proj = projection_head(joint, proj_dim, head)
        self.text_teacher_proj = projection_head(text_teacher_dim or hidden, proj_dim, head)
        self.shared_text = mlp_head(hidden, proj_dim)
        self.shared_image = mlp_head(joint, proj_dim)
        self.image_dim, self.joint_dim, self.joint_text_dim, self.proj_dim = image_dim, joint, joint_text, proj_dim
        self.text_teacher_dim, self.head = text_teacher_dim or hidden, head
        # SimCSE's MLM head (`load_mlm_head`), set by training when loss.simcse.mlm is on: training only
        self.mlm_head: MaskedLMHead | None = None

    def token_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer token states ``(B, L, H)``; [CLS] before the pooler is ``[:, 0]``."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def cls(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.token_states(input_ids, attention_mask)[:, 0]  # (B, H): [CLS] before the pooler

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooler: str) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return pool(pooler, out.hidden_states, attention_mask, self.mlp)

    def heads_state(self) -> dict[str, torch.Tensor]:
        return {
            f"{name}.{k}": v.detach().contiguous()
            for name in HEADS
            for k, v in getattr(self, name).state_dict().items()
        }


def save_student(student: Student, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """An HF model folder (safetensors) that any HF loader reads, plus the heads beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    student.backbone.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    save_file(student.heads_state(), str(folder / HEADS_FILE))
    (folder / HEADS_META).write_text(
        json.dumps({"image_dim": student.image_dim, "proj_dim": student.proj_dim, "joint_dim": student.joint_dim,
                    "joint_text_dim": student.joint_text_dim, "text_teacher_dim": student.text_teacher_dim,
                    "projection_head": student.head})
    )


def load_student(folder: str | Path) -> tuple[Student, PreTrainedTokenizerBase]:
    folder = Path(folder)
    meta = json.loads((folder / HEADS_META).read_text())
    backbone = AutoModel.from_pretrained(folder, add_pooling_layer=False)
    # folders written before text_teacher_proj and model.projection_head: linear heads, no DALR g_φt
    student = Student(backbone, meta["image_dim"], meta["proj_dim"], meta.get("joint_dim", 0),
                      meta.get("text_teacher_dim", 0), meta.get("projection_head", "linear"),
                      meta.get("joint_text_dim", 0))
    heads = load_file(str(folder / HEADS_FILE))
    names = HEADS if "projection_head" in meta else tuple(h for h in HEADS if h != "text_teacher_proj")
    for name in names:
        prefix = f"{name}."
        getattr(student, name).load_state_dict(
            {k[len(prefix) :]: v for k, v in heads.items() if k.startswith(prefix)}
        )
    return student, AutoTokenizer.from_pretrained(folder)
