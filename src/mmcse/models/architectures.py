"""The architectures of the model ids the recipes and profiles name, so a model can be built at its real
shapes with random weights on a machine that has never downloaded it (`mmcse preflight`).

Each entry is the Hugging Face configuration the id's ``config.json`` holds (the fields that set shapes;
every other field keeps transformers' default). The SimCSE, DiffCSE and RankCSE checkpoints are
BERT-base / RoBERTa-base fine-tuned, so they share those shapes. An id that is neither here nor on the
machine is named with the fix (`UnknownArchitecture`).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import BertConfig, CLIPConfig, PretrainedConfig, RobertaConfig

from mmcse.errors import ModelUnavailableError
from mmcse.hub import hf_download_command, local_model


def _bert_base() -> PretrainedConfig:
    return BertConfig()  # transformers' defaults are bert-base-uncased's: 12 × 768, 12 heads, 3072, vocab 30522


def _bert_large() -> PretrainedConfig:
    return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)


def _roberta(hidden: int, layers: int, heads: int, ff: int) -> Callable[[], PretrainedConfig]:
    # roberta-base's config.json: vocab 50265, 514 positions (2 offset by the padding id), one token type
    return lambda: RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1,
                                 layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                 hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                 intermediate_size=ff)


def _clip_b32() -> PretrainedConfig:
    return CLIPConfig()  # transformers' defaults are openai/clip-vit-base-patch32's: ViT-B/32, 512-d projection


def _clip_l14() -> PretrainedConfig:
    return CLIPConfig(
        text_config={"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "projection_dim": 768},
        vision_config={"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                       "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
        projection_dim=768)


ARCHITECTURES: dict[str, Callable[[], PretrainedConfig]] = {
    "bert-base-uncased": _bert_base,
    "bert-base-cased": lambda: BertConfig(vocab_size=28996),
    "bert-large-uncased": _bert_large,
    "roberta-base": _roberta(768, 12, 12, 3072),
    "roberta-large": _roberta(1024, 24, 16, 4096),
    "princeton-nlp/unsup-simcse-bert-base-uncased": _bert_base,
    "princeton-nlp/sup-simcse-bert-base-uncased": _bert_base,
    "princeton-nlp/unsup-simcse-roberta-base": _roberta(768, 12, 12, 3072),
    "princeton-nlp/sup-simcse-roberta-base": _roberta(768, 12, 12, 3072),
    "voidism/diffcse-bert-base-uncased-sts": _bert_base,
    "voidism/diffcse-roberta-base-sts": _roberta(768, 12, 12, 3072),
    "perceptiveshawty/rankcse-listmle-bert-base-uncased": _bert_base,
    "openai/clip-vit-base-patch32": _clip_b32,
    "openai/clip-vit-large-patch14": _clip_l14,
}


def model_config(name_or_path: str) -> tuple[PretrainedConfig, bool]:
    """``(configuration, on this machine)`` of a model id or folder: its own ``config.json`` where the
    model is here (a folder, a packaged model, the hub cache), else `ARCHITECTURES`' entry; nothing is
    downloaded. An id in neither raises ModelUnavailableError saying how to get it or add it."""
    from transformers import AutoConfig

    location = local_model(name_or_path)
    if location is not None:
        return AutoConfig.from_pretrained(location), True
    if name_or_path in ARCHITECTURES:
        return ARCHITECTURES[name_or_path](), False
    raise ModelUnavailableError(
        f"{name_or_path!r} is not on this machine and not in mmcse's architecture table "
        f"(mmcse.models.architectures.ARCHITECTURES): download it (`{hf_download_command(name_or_path)}`) or "
        "add its configuration there")


def text_width(config: PretrainedConfig) -> int:
    """The width of a text encoder's token states (a CLIP's: its text tower's)."""
    text = getattr(config, "text_config", None)
    return int((text or config).hidden_size)


def projection_width(config: PretrainedConfig) -> int:
    """The width of a CLIP's joint space (``projection_dim``)."""
    return int(config.projection_dim)
