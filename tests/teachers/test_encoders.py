"""Real teacher families built with random weights from configs: ResNet-50, CLIP through
transformers, open_clip. Features of the right shape, equal to a direct forward pass; offline
ids fail fast; the pipeline caches them and a cache hit builds no model."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmcse.hub import ModelUnavailableError
from mmcse.teachers import encoders as tm


@pytest.fixture
def image_files(tmp_path):
    rng = np.random.default_rng(0)
    files = []
    for i in range(3):
        rgba = rng.integers(0, 256, size=(40, 48, 4), dtype=np.uint8)
        rgba[:, :20, 3] = 0  # a transparent left part, as an object crop has
        path = tmp_path / f"im{i}.png"
        Image.fromarray(rgba, "RGBA").save(path)
        files.append(path)
    return files


def test_transparent_background_becomes_black(image_files):
    img = np.asarray(tm.rgb_on_black(image_files[0]))
    src = np.asarray(Image.open(image_files[0]))
    assert img.shape == (40, 48, 3) and (img[:, :20] == 0).all()
    np.testing.assert_array_equal(img[:, 20:][src[:, 20:, 3] == 255], src[:, 20:, :3][src[:, 20:, 3] == 255])
    (image_files[0].parent / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="bad.png"):
        tm.rgb_on_black(image_files[0].parent / "bad.png")


def test_resnet50_from_a_local_weights_file_matches_a_direct_forward(image_files, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = tm.build_resnet50(None)
    state = {f"{k}": v for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / "r50.safetensors"))
    path, preprocess, described = tm.resolve_resnet50(str(tmp_path / "r50.safetensors"))
    got = tm.resnet50_features(image_files, tm.build_resnet50(path), preprocess, batch_size=2, num_workers=0,
                               device=torch.device("cpu"))
    assert got.shape == (3, 2048) and got.dtype == np.float32
    assert len(described["sha256"]) == 64 and "Resize" in described["preprocess"]
    with torch.no_grad():
        direct = reference(torch.stack([preprocess(tm.rgb_on_black(f)) for f in image_files]))
    np.testing.assert_allclose(got, torch.nn.functional.normalize(direct, dim=-1).numpy(), atol=1e-5)
    save_file({"conv1.weight": torch.zeros(1)}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="not ResNet-50 weights"):
        tm.build_resnet50(tmp_path / "wrong.safetensors")


def test_resnet50_offline_without_cached_weights_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="resnet50-.*offline"):
        tm.resolve_resnet50("IMAGENET1K_V2")
    with pytest.raises(ModelUnavailableError, match="torchvision weights name"):
        tm.resolve_resnet50("IMAGENET9K")


def test_no_download_asked_and_no_weights_cached_is_a_clear_error_even_online(tmp_path, monkeypatch):
    """`mmcse preflight` asks for the weights without a download: online or not, nothing is fetched."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(tm, "offline", lambda: False)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(ModelUnavailableError,
            match=r"IMAGENET1K_V2 are not in torch hub's cache \(.*resnet50-.*\): download"):
        tm.resolve_resnet50("IMAGENET1K_V2", download=False)
    import open_clip

    monkeypatch.setattr(open_clip, "download_pretrained", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(ModelUnavailableError, match="ViT-B-32/openai is not in the local cache: download"):
        tm.resolve_open_clip("ViT-B-32", "openai", download=False)


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's byte-level alphabet (every byte gets a printable character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


@pytest.fixture
def tiny_clip(tmp_path):
    """A 2-layer CLIP with random weights, its byte-level tokenizer (no merges) and a 32-px processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=40, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=16),
        projection_dim=24,
    )
    torch.manual_seed(0)
    folder = tmp_path / "clip"
    CLIPModel(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_clip_features_match_the_model(tiny_clip, image_files):
    captions = ["a red box", "two small blue discs on grey", "x"]
    t, v = tm.clip_features(str(tiny_clip), captions, image_files, batch_size=2, num_workers=0,
                            device=torch.device("cpu"))
    assert t.shape == (3, 24) and v.shape == (3, 24) and t.dtype == v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, atol=1e-5)
    model, processor = tm.load_clip(str(tiny_clip))
    with torch.no_grad():
        for i, caption in enumerate(captions):  # one at a time: no padding involved
            ids = processor.tokenizer([caption], return_tensors="pt")
            direct = tm._features(model.get_text_features(**ids))[0]
            np.testing.assert_allclose(t[i], torch.nn.functional.normalize(direct, dim=-1).numpy(), atol=1e-5)
        pixels = processor.image_processor(images=[tm.rgb_on_black(f) for f in image_files],
                                           return_tensors="pt")["pixel_values"]
        direct = tm._features(model.get_image_features(pixel_values=pixels))
    np.testing.assert_allclose(v, torch.nn.functional.normalize(direct, dim=-1).numpy(), atol=1e-5)
    assert tm.describe_clip(str(tiny_clip))["revision"] == "local"


def test_clip_hub_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="openai/clip-vit-base-patch32.*HF_HUB_OFFLINE"):
        tm.describe_clip("openai/clip-vit-base-patch32")


@pytest.fixture
def tiny_open_clip():
    import open_clip
    from open_clip.factory import _MODEL_CONFIGS

    _MODEL_CONFIGS["mmcse-tiny"] = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    assert "mmcse-tiny" in open_clip.list_models()
    yield "mmcse-tiny"
    _MODEL_CONFIGS.pop("mmcse-tiny", None)


def test_open_clip_features_match_the_model(tiny_open_clip, image_files):
    torch.manual_seed(0)
    t, v = tm.open_clip_features(tiny_open_clip, "random", ["a red box", "a cat"], image_files, batch_size=2,
                                 num_workers=0, device=torch.device("cpu"))
    assert t.shape == (2, 16) and v.shape == (3, 16)
    torch.manual_seed(0)
    model, preprocess, tokenizer = tm.load_open_clip(tiny_open_clip, "random")
    with torch.no_grad():
        direct = model.encode_image(torch.stack([preprocess(tm.rgb_on_black(f)) for f in image_files]))
        text = model.encode_text(tokenizer(["a red box", "a cat"]))
    np.testing.assert_allclose(v, torch.nn.functional.normalize(direct, dim=-1).numpy(), atol=1e-5)
    np.testing.assert_allclose(t, torch.nn.functional.normalize(text, dim=-1).numpy(), atol=1e-5)


def test_open_clip_unknown_or_uncached_checkpoints_fail_fast(monkeypatch, tmp_path):
    with pytest.raises(ModelUnavailableError, match="no model"):
        tm.resolve_open_clip("ViT-Nope", "openai")
    with pytest.raises(ModelUnavailableError, match="unknown pretrained tag"):
        tm.resolve_open_clip("ViT-B-32", "nonsense")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="ViT-B-32/openai.*offline"):
        tm.resolve_open_clip("ViT-B-32", "openai")


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_pipeline_caches_real_teachers_and_a_hit_builds_no_model(project, tiny_clip, monkeypatch):
    """cache_teachers with ResNet-50 and CLIP (random weights): sets of the right widths;
    rerun = all hits, and neither model is built."""
    from mmcse.config import with_overrides
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths
    from mmcse.teachers.cache import FeatureStore

    cfg = with_overrides(load_config("params.yaml"), {
        "teachers.image_encoder": "resnet50", "teachers.image_weights": "random", "teachers.num_workers": 0,
        "teachers.joint.kind": "clip", "teachers.joint.model": str(tiny_clip)})
    result = run_cache_teachers(cfg, Paths.of(cfg))
    sets = result["sets"]
    assert FeatureStore.open(f"data/teachers/{sets['image']}").dim == 2048
    assert FeatureStore.open(f"data/teachers/{sets['object']}").dim == 2048
    assert FeatureStore.open(f"data/teachers/{sets['joint_text']}").dim == 24
    assert FeatureStore.open(f"data/teachers/{sets['joint_image']}").dim == 24
    assert not result["hits"]["image"] and not result["hits"]["joint_text"]

    def no_model(*args, **kwargs):
        raise AssertionError("a cache hit built a model")

    monkeypatch.setattr(tm, "build_resnet50", no_model)
    monkeypatch.setattr("mmcse.teachers.cache.build_resnet50", no_model)  # where the cache calls it
    monkeypatch.setattr(tm, "load_clip", no_model)
    again = run_cache_teachers(cfg, Paths.of(cfg))
    assert all(again["hits"].values()) and again["sets"] == sets


def test_the_joint_teachers_text_side_as_a_text_teacher(project, tiny_clip):
    """DALR Table 9's "CLIP" text teacher (teachers.text: joint): captions get the joint teacher's
    t̂ itself, corpus sentences CLIP's text feature computed directly; the CCA stand-in gives the
    fitted text side of its own text teacher's corpus features."""
    from mmcse.config import ConfigError, with_overrides
    from mmcse.experiments.params import load_config
    from mmcse.io import read_jsonl
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths
    from mmcse.teachers.cache import FeatureStore, fit_cca

    corpus = [s for s in Path("data/raw/corpus.txt").read_text().splitlines() if s.strip()]
    clip = with_overrides(load_config("params.yaml"), {
        "teachers.joint.kind": "clip", "teachers.joint.model": str(tiny_clip), "teachers.num_workers": 0,
        "teachers.text": [{"teacher": "joint"}, {"teacher": "packaged:all-MiniLM-L6-v2", "pooler": "avg"}]})
    sets = run_cache_teachers(clip, Paths.of(clip))["sets"]
    joint, minilm = sets["text"]
    assert joint["teacher"] == "joint" and joint["caption"] == sets["joint_text"]
    got = np.asarray(FeatureStore.open(f"data/teachers/{joint['corpus']}").features)
    one_image = [Path("data/raw") / next(iter(read_jsonl("data/raw/images.jsonl")))["file"]]
    want, _ = tm.clip_features(str(tiny_clip), corpus, one_image, 8, 0, torch.device("cpu"))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert FeatureStore.open(f"data/teachers/{minilm['corpus']}").dim == 384  # the other teacher as before

    cca = with_overrides(load_config("params.yaml"), {"teachers.text": [{"teacher": "joint"}]})
    sets = run_cache_teachers(cca, Paths.of(cca))["sets"]
    (joint,) = sets["text"]
    j = cca.teachers.joint
    source = next(x for x in run_cache_teachers(
        with_overrides(cca, {"teachers.text": [{"teacher": j.text_teacher, "pooler": j.text_pooler}]}),
        Paths.of(cca))["sets"]["text"])
    fitted_on = np.asarray(FeatureStore.open(f"data/teachers/{source['caption']}").features)
    images = FeatureStore.open(f"data/teachers/{sets['image']}")
    pair_images = images.rows([p["image_id"] for p in read_jsonl("data/raw/pairs.jsonl")])
    fit = fit_cca(fitted_on, pair_images, j.dim, j.regularization)
    corpus_source = np.asarray(FeatureStore.open(f"data/teachers/{source['corpus']}").features)
    np.testing.assert_allclose(np.asarray(FeatureStore.open(f"data/teachers/{joint['corpus']}").features),
                               fit.text(corpus_source), atol=1e-5)
    assert joint["caption"] == sets["joint_text"]
    with pytest.raises(ConfigError, match=r"teachers.text\[0\].pooler.*pools its own way"):
        with_overrides(cca, {"teachers.text": [{"teacher": "joint", "pooler": "cls_before_pooler"}]})


def test_a_clip_model_as_a_text_teacher_gives_its_projected_text_feature(tiny_clip):
    """teachers.text pooler clip (DALR Table 9's "CLIP" text teacher beside a ResNet image teacher):
    the projection of CLIP's pooled EOS state, L2-normalised, computed directly here."""
    from transformers import CLIPModel, CLIPTokenizer

    from mmcse.config import ConfigError, parse_config
    from mmcse.teachers.cache import text_teacher_features

    sentences = ["a red box", "two dogs run on a beach", "a cat"]
    got = text_teacher_features(str(tiny_clip), sentences, ["clip"], batch_size=2)["clip"]
    model, tok = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPTokenizer.from_pretrained(tiny_clip)
    with torch.no_grad():
        for i, s in enumerate(sentences):
            ids = tok([s], return_tensors="pt")
            out = model.text_model(**ids)
            want = model.text_projection(out.pooler_output)[0]
            np.testing.assert_allclose(got[i], (want / want.norm()).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="CLIP model .*no \\['avg'\\] pooling"):
        text_teacher_features(str(tiny_clip), sentences, ["clip", "avg"], batch_size=2)
    with pytest.raises(ConfigError, match="a CLIP model \\(pooler clip\\) has no other pooler"):
        parse_config({"teachers": {"text": [{"teacher": "m", "pooler": "clip"}, {"teacher": "m", "pooler": "avg"}]}})


def test_clips_image_transform_reaches_loader_workers_started_by_spawn(tmp_path):
    """The DataLoader's workers receive the transform pickled (spawn, forkserver: Python 3.14's default, and
    every process `mmcse preflight` starts): a closure could not be."""
    import pickle

    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor()
    image = Image.new("RGB", (320, 240), (200, 30, 40))
    transform = pickle.loads(pickle.dumps(tm.ClipPixels(processor)))
    expected = processor(images=image, return_tensors="pt")["pixel_values"][0]
    assert transform(image).shape == (3, 224, 224) and torch.equal(transform(image), expected)
