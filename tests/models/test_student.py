"""The student's projection heads (``model.projection_head``) and its folder round trip."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mmcse.config import parse_config
from mmcse.models.student import (
    HEADS,
    HEADS_FILE,
    HEADS_META,
    Student,
    load_backbone,
    load_mlm_head,
    load_student,
    load_tokenizer,
    projection_head,
    save_student,
)
from tests.conftest import TINY_MODEL


def test_tanh_head_is_dense_then_tanh_and_linear_is_one_layer():
    """KDMCSE §4.1 / the authors' MLPLayer: g(x) = tanh(W x + b), no hidden layer."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    tanh = projection_head(6, 3, "tanh").double()
    dense = tanh[0]
    want = torch.tanh(x @ dense.weight.T + dense.bias)
    torch.testing.assert_close(tanh(x), want, rtol=0, atol=1e-12)
    # gradient: d tanh(u)/du = 1 − tanh(u)², through W
    tanh(x).sum().backward()
    torch.testing.assert_close(dense.weight.grad, ((1 - want.detach() ** 2).T @ x.detach()), rtol=0, atol=1e-12)
    linear = projection_head(6, 3, "linear").double()
    torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="model.projection_head: 'relu'; choose one of tanh, linear"):
        projection_head(6, 3, "relu")


def _student(head: str, joint_text_dim: int = 0) -> tuple[Student, object]:
    cfg = parse_config({"model": dict(TINY_MODEL, projection_head=head)}).model
    torch.manual_seed(0)
    return Student(load_backbone(cfg), 24, cfg.proj_dim, 16, text_teacher_dim=20, head=head,
                   joint_text_dim=joint_text_dim), \
        load_tokenizer(cfg.name_or_path)


@pytest.mark.parametrize("head", ["tanh", "linear"])
def test_a_saved_student_loads_with_the_same_heads(tmp_path, head):
    student, tok = _student(head, joint_text_dim=12)
    save_student(student, tok, tmp_path / "s")
    meta = json.loads((tmp_path / "s" / HEADS_META).read_text())
    assert meta == {"image_dim": 24, "proj_dim": 32, "joint_dim": 16, "joint_text_dim": 12, "text_teacher_dim": 20,
                    "projection_head": head}
    assert load_student(tmp_path / "s")[0].teacher_text_proj(torch.randn(2, 12)).shape == (2, 32)  # t̂'s own width
    again, _ = load_student(tmp_path / "s")
    x = torch.randn(3, 20)
    torch.testing.assert_close(again.text_teacher_proj(x), student.text_teacher_proj(x), rtol=0, atol=0)
    assert again.heads_state().keys() == student.heads_state().keys()
    for k, v in student.heads_state().items():
        assert torch.equal(again.heads_state()[k], v), k


def test_a_folder_from_before_the_paper_heads_loads_as_linear(tmp_path):
    """Folders written before model.projection_head and DALR's g_φt: single Linear heads, no
    text_teacher_proj in heads.safetensors, and heads.json without the two fields."""
    student, tok = _student("linear")
    save_student(student, tok, tmp_path / "old")
    old = {k: v for k, v in student.heads_state().items() if not k.startswith("text_teacher_proj.")}
    save_file(old, str(tmp_path / "old" / HEADS_FILE))
    (tmp_path / "old" / HEADS_META).write_text(json.dumps({"image_dim": 24, "proj_dim": 32, "joint_dim": 16}))
    again, _ = load_student(tmp_path / "old")
    assert again.head == "linear" and isinstance(again.image_proj, torch.nn.Linear)
    assert torch.equal(again.image_proj.weight, student.image_proj.weight)
    assert set(HEADS) == {n.split(".")[0] for n in again.heads_state()}


def test_save_tokenizer_writes_the_loaded_state_whatever_calls_ran_before(tmp_path):
    """A tokenizer call with truncation / padding rewrites the fast backend's state, which
    save_pretrained writes out; save_tokenizer writes the state as loaded and leaves the current one."""
    from mmcse.models.student import load_tokenizer, save_tokenizer

    fresh = load_tokenizer("packaged:all-MiniLM-L6-v2")
    save_tokenizer(fresh, tmp_path / "fresh")
    used = load_tokenizer("packaged:all-MiniLM-L6-v2")
    used(["a short one", "two"], truncation=True, max_length=7, padding=True)
    state = (used.backend_tokenizer.truncation, used.backend_tokenizer.padding)
    assert state[0]["max_length"] == 7  # the call did change it
    save_tokenizer(used, tmp_path / "used")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / "fresh" / name).exists():
            assert (tmp_path / "used" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    assert (used.backend_tokenizer.truncation, used.backend_tokenizer.padding) == state
    used.save_pretrained(tmp_path / "plain")  # what the checkpoint held before: the last call's state
    assert (tmp_path / "plain/tokenizer.json").read_bytes() != (tmp_path / "fresh/tokenizer.json").read_bytes()


def _mlm_folder(tmp_path, kind: str = "bert"):
    """A tiny masked-LM checkpoint (the MiniLM tokenizer beside it) with a head of known weights."""
    from transformers import AutoModelForMaskedLM, BertConfig, DistilBertConfig

    tokenizer = load_tokenizer("packaged:all-MiniLM-L6-v2")
    small = {"vocab_size": tokenizer.vocab_size}
    config = (BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, **small)
              if kind == "bert" else DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, **small))
    torch.manual_seed(9)
    model = AutoModelForMaskedLM.from_config(config)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def test_the_mlm_head_is_the_checkpoints_own_or_new(tmp_path, caplog):
    """loss.simcse.mlm_head: pretrained reads the checkpoint's head; new is fresh weights (SimCSE's
    BertForCL); a checkpoint without a head (a sentence-transformers folder) starts one and says so."""
    folder, saved, tokenizer = _mlm_folder(tmp_path)
    model = parse_config({"model": {"name_or_path": str(folder)}}).model
    own = load_mlm_head(model, tokenizer, "pretrained")
    want = saved.cls.predictions.transform.dense.weight
    assert torch.equal(own.head.predictions.transform.dense.weight, want)
    assert own.mask_id == tokenizer.mask_token_id and own.vocab == tokenizer.vocab_size
    assert set(own.special_ids.tolist()) == set(tokenizer.all_special_ids)
    torch.manual_seed(1)
    new = load_mlm_head(model, tokenizer, "new")
    assert not torch.equal(new.head.predictions.transform.dense.weight, want)
    states = torch.randn(4, 32)
    assert own(states).shape == (4, tokenizer.vocab_size)
    # the head's decoder is its own parameter, not the student's input embeddings
    student = Student(load_backbone(model), 8, 8)
    decoder = own.head.predictions.decoder.weight
    assert decoder.data_ptr() != student.backbone.embeddings.word_embeddings.weight.data_ptr()

    with caplog.at_level("WARNING", logger="mmcse.models.student"):
        packaged = load_mlm_head(parse_config({}).model, load_tokenizer("packaged:all-MiniLM-L6-v2"), "pretrained")
    assert "has no masked-LM head" in caplog.text and packaged.head is not None


def test_a_family_without_one_mlm_head_module_is_named(tmp_path):
    folder, _, tokenizer = _mlm_folder(tmp_path, "distilbert")
    model = parse_config({"model": {"name_or_path": str(folder)}}).model
    with pytest.raises(ValueError, match="DistilBertForMaskedLM has no single masked-LM head module"):
        load_mlm_head(model, tokenizer, "pretrained")
