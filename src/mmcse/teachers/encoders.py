"""Real frozen teachers: ResNet-50 (torchvision), CLIP (transformers) and open_clip models.

Each loader resolves its weights locally first and fails fast with instructions when they
are not here (offline machine, empty cache); each feature function runs batched, with a
DataLoader and workers for images, bf16 autocast on GPU, a progress bar, and returns
L2-normalised float32 ``(N, d)``. :func:`describe` gives what a cache key must hold:
model id, revision and preprocessing.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file as load_safetensors
from tqdm.auto import tqdm

from mmcse.data.images import IMAGENET_MEAN, IMAGENET_STD
from mmcse.errors import InputError
from mmcse.hub import ModelUnavailableError, offline, resolve_model
from mmcse.io import open_image, sha256_file
from mmcse.models.cnn import RESNETS, pooled_resnet

# --------------------------------------------------------------------------- images


def rgb_on_black(path: Path) -> Image.Image:
    """An image as RGB; a transparent background (MCSEO object crops) becomes black, so the
    encoder sees only the object. A missing or corrupt file is a clear error naming it."""
    img = open_image(path)
    if img.mode not in ("RGBA", "LA", "P"):
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    canvas = Image.new("RGB", rgba.size, (0, 0, 0))
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    return canvas


class ImageFiles(torch.utils.data.Dataset):
    """Image files → preprocessed ``(3, H, W)`` tensors (read in DataLoader workers)."""

    def __init__(self, files: Sequence[Path], transform: Callable[[Image.Image], torch.Tensor]):
        self.files, self.transform = list(files), transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(rgb_on_black(self.files[i]))


def _image_batches(files: Sequence[Path], transform, batch_size: int, num_workers: int, desc: str):
    loader = torch.utils.data.DataLoader(
        ImageFiles(files, transform), batch_size=batch_size, num_workers=num_workers, shuffle=False
    )
    return tqdm(loader, desc=desc, unit="batch")


def _autocast(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def _normalised(chunks: list[torch.Tensor]) -> np.ndarray:
    out = torch.cat(chunks).float()
    return torch.nn.functional.normalize(out, dim=-1).cpu().numpy().astype(np.float32)


# --------------------------------------------------------------------------- ResNet-50


def resize_crop_normalise(resize: int = 256, crop: int = 224) -> Callable:
    """ImageNet's evaluation transform: the shorter side to ``resize``, the center ``crop``, ImageNet's mean/std."""
    from torchvision import transforms

    return transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop), transforms.ToTensor(),
                               transforms.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))])




def _resnet_name(arch: str) -> str:
    return f"ResNet-{arch.removeprefix('resnet')}"  # ResNet-50, as messages name it


def _torchvision_weights(spec: str, arch: str = "resnet50", setting: str = "teachers.image_weights"):
    import torchvision

    name = spec if "." in spec else f"{RESNETS[arch]}_Weights.{spec}"
    try:
        return torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError):
        raise ModelUnavailableError(
            f"{setting}={spec!r} is neither a local weights file nor a torchvision weights "
            "name (e.g. IMAGENET1K_V2)"
        ) from None


def _download_timeout(seconds: float):
    class _Timeout:
        def __enter__(self):
            self.old = socket.getdefaulttimeout()
            socket.setdefaulttimeout(seconds)

        def __exit__(self, *exc):
            socket.setdefaulttimeout(self.old)

    return _Timeout()


def resolve_resnet50(weights: str, arch: str = "resnet50", setting: str = "teachers.image_weights",
                     download: bool = True) -> tuple[Path | None, Callable, dict[str, Any]]:
    """Where ResNet-50's (``arch``'s: `RESNETS`) weights are, its preprocessing, and what a cache key
    must hold — no model is built. ``weights``: a torchvision weights name (taken from torch hub's cache,
    downloaded only when online and ``download``), a local ``.pth``/``.safetensors`` file, or ``random``;
    ``setting``: the key an error tells the user to change."""
    if arch not in RESNETS:
        raise InputError(f"{arch!r} is not one of {sorted(RESNETS)}")
    preprocess: Callable = resize_crop_normalise()
    described: dict[str, Any] = {"model": f"torchvision/{arch}", "weights": weights}
    path: Path | None = None
    if weights != "random":
        path = Path(weights).expanduser()
        if path.is_file():
            described["sha256"] = sha256_file(path)
        else:
            enum = _torchvision_weights(weights, arch, setting)
            path = Path(torch.hub.get_dir()) / "checkpoints" / Path(enum.url).name
            if not path.is_file():
                if offline() or not download:
                    raise ModelUnavailableError(
                        f"{_resnet_name(arch)} weights {weights} are not in torch hub's cache ({path})"
                        f"{' and the machine is offline' if download else ''}: download {enum.url} there, "
                        f"or set {setting} to a local file"
                    )
                try:
                    with _download_timeout(20):
                        torch.hub.load_state_dict_from_url(enum.url, progress=True, check_hash=True)
                except Exception as err:
                    raise ModelUnavailableError(
                        f"{_resnet_name(arch)} weights {weights}: download of {enum.url} failed "
                        f"({type(err).__name__}); put the file at {path} or set {setting} to a local file"
                    ) from None
            preprocess = enum.transforms()
            described["file"] = path.name  # torchvision's file names carry a hash prefix
    described["preprocess"] = repr(preprocess)
    return path, preprocess, described


def build_resnet50(path: Path | None, arch: str = "resnet50") -> torch.nn.Module:
    """ResNet-50 (``arch``: `RESNETS`) without its classifier: 2048-d pooled features (random weights
    without a file)."""
    model = pooled_resnet(arch)
    if path is not None:
        if path.suffix == ".safetensors":
            state = load_safetensors(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}  # the classifier is not kept
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shape mismatches
            raise InputError(f"{path}: not {_resnet_name(arch)} weights "
                             f"({str(err).splitlines()[-1].strip()})") from None
        if missing or unexpected:
            raise InputError(f"{path}: not {_resnet_name(arch)} weights (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    return model.eval()


def resnet50_features(
    files: Sequence[Path], model: torch.nn.Module, preprocess: Callable, batch_size: int, num_workers: int,
    device: torch.device,
) -> np.ndarray:
    """ResNet-50 features ``(N, 2048)`` of image files (MCSE's image encoder, MCSEO's object
    encoder) from ``build_resnet50``'s model and ``resolve_resnet50``'s preprocessing,
    L2-normalised float32."""
    model = model.to(device)
    chunks = []
    with torch.inference_mode(), _autocast(device):
        for pixels in _image_batches(files, preprocess, batch_size, num_workers, "teacher: resnet50"):
            chunks.append(model(pixels.to(device)))
    return _normalised(chunks)


GRID_RESIZE, GRID_CROP, GRID_STRIDE = 256, 224, 32  # VSE++'s test transform; ResNet's last stage is 1/32


def crop_grid_boxes(width: int, height: int, resize: int = GRID_RESIZE, crop: int = GRID_CROP,
                    stride: int = GRID_STRIDE) -> np.ndarray:
    """``(g·g, 4)`` xyxy pixel boxes, in the original image, of the cells of a ResNet's last feature map
    (g = crop / stride, row-major) for the image resized to ``resize`` on its shorter side and
    center-cropped to ``crop`` (torchvision's Resize and CenterCrop arithmetic), clipped to the image."""
    scale = resize / min(width, height)
    w, h = (resize, int(resize * height / width)) if width <= height else (int(resize * width / height), resize)
    left, top = int(round((w - crop) / 2.0)), int(round((h - crop) / 2.0))
    g = crop // stride
    rows, cols = np.divmod(np.arange(g * g), g)
    boxes = np.stack([left + cols * stride, top + rows * stride, left + (cols + 1) * stride,
                      top + (rows + 1) * stride], axis=1).astype(np.float64) / scale
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, width)
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, height)
    return boxes.astype(np.float32)


def resnet_grid_features(files: Sequence[Path], model: torch.nn.Module, batch_size: int, num_workers: int,
                         device: torch.device) -> np.ndarray:
    """The last feature map of ``build_resnet50``'s model (any of `RESNETS`) as a grid of regions:
    ``(N, 49, 2048)`` float32, row-major cells, not normalised (their mean is the pooled feature VSE++
    reads), of each image resized to 256 and center-cropped to 224 (VSE++'s test transform, data.py
    ``get_transform``)."""
    preprocess = resize_crop_normalise(GRID_RESIZE, GRID_CROP)
    trunk = torch.nn.Sequential(*(module for name, module in model.named_children()
                                  if name not in ("avgpool", "fc"))).to(device)
    chunks = []
    with torch.inference_mode(), _autocast(device):
        for pixels in _image_batches(files, preprocess, batch_size, num_workers, "regions: resnet grid"):
            grid = trunk(pixels.to(device))  # (B, 2048, 7, 7)
            chunks.append(grid.flatten(2).transpose(1, 2).float().cpu())  # (B, 49, 2048)
    return torch.cat(chunks).numpy() if chunks else np.zeros((0, 0, 0), np.float32)


# --------------------------------------------------------------------------- CLIP


def revision(location: str) -> str:
    """The hub snapshot (commit) a resolved folder comes from, or ``local``."""
    parts = Path(location).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else "local"


def describe_clip(model_id: str) -> dict[str, Any]:
    """Cache-key description of a transformers CLIP (resolves the weights, builds nothing)."""
    location = resolve_model(model_id)
    return {"model": model_id, "revision": revision(location), "preprocess": "CLIPProcessor"}


def load_clip(model_id: str):
    """A transformers CLIP model and processor from a hub id (cache first) or a local folder."""
    from transformers import AutoProcessor, CLIPModel

    location = resolve_model(model_id)
    return CLIPModel.from_pretrained(location).eval(), AutoProcessor.from_pretrained(location)


def _features(out: Any) -> torch.Tensor:
    return out if torch.is_tensor(out) else out.pooler_output  # transformers 5 returns an output object


class ClipPixels:
    """A CLIP image processor as a DataLoader transform: an image → ``(3, H, W)`` pixel values. A class, not a
    closure, so the loader's workers can receive it whatever their start method (spawn, forkserver)."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return self.image_processor(images=img, return_tensors="pt")["pixel_values"][0]


def clip_features(
    model_id: str, captions: Sequence[str], image_files: Sequence[Path], batch_size: int, num_workers: int,
    device: torch.device, loaded: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """CLIP text features of ``captions`` and image features of ``image_files`` (the joint
    teacher's t̂, v̂: KDMCSE Eq. 5–6), each L2-normalised float32."""
    model, processor = loaded or load_clip(model_id)
    model = model.to(device)
    text = clip_text_features(model_id, captions, batch_size, device, (model, processor))
    image_chunks = []
    transform = ClipPixels(processor.image_processor)
    with torch.inference_mode(), _autocast(device):
        for pixels in _image_batches(image_files, transform, batch_size, num_workers, f"teacher {model_id}: images"):
            image_chunks.append(_features(model.get_image_features(pixel_values=pixels.to(device))))
    return text, _normalised(image_chunks)


def clip_text_features(model_id: str, sentences: Sequence[str], batch_size: int, device: torch.device,
                       loaded: Any = None) -> np.ndarray:
    """CLIP's projected text feature of each sentence ``(N, d)``, L2-normalised float32 (the joint
    teacher's t̂; as a text teacher, DALR Table 9's "CLIP"), truncated to CLIP's context length."""
    model, processor = loaded or load_clip(model_id)
    model = model.to(device)
    chunks = []
    max_len = model.config.text_config.max_position_embeddings
    with torch.inference_mode(), _autocast(device):
        for start in tqdm(range(0, len(sentences), batch_size), desc=f"teacher {model_id}: text", unit="batch"):
            batch = processor.tokenizer(list(sentences[start : start + batch_size]), padding=True, truncation=True,
                                        max_length=max_len, return_tensors="pt").to(device)
            chunks.append(_features(model.get_text_features(input_ids=batch["input_ids"],
                                                            attention_mask=batch["attention_mask"])))
    if not chunks:
        return np.zeros((0, model.config.projection_dim), np.float32)
    return _normalised(chunks)


def resolve_open_clip(architecture: str, pretrained: str, download: bool = True) -> str | None:
    """A local checkpoint for open_clip ``architecture`` + ``pretrained`` (a tag such as
    ``openai``, or a file); None for ``random``. Cache first, download only when online and ``download``."""
    import open_clip

    if pretrained == "random":
        return None
    path = Path(pretrained).expanduser()
    if path.is_file():
        return str(path)
    if architecture not in open_clip.list_models():
        raise ModelUnavailableError(f"open_clip has no model {architecture!r} (open_clip.list_models())")
    cfg = open_clip.get_pretrained_cfg(architecture, pretrained)
    if not cfg:
        tags = [t for m, t in open_clip.list_pretrained() if m == architecture]
        raise ModelUnavailableError(f"open_clip {architecture}: unknown pretrained tag {pretrained!r}; tags: {tags}")
    if offline() or not download:
        hub_id = cfg.get("hf_hub", "").rstrip("/")
        if hub_id:
            from huggingface_hub import try_to_load_from_cache

            for name in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
                found = try_to_load_from_cache(hub_id, name)
                if isinstance(found, str):
                    return found
        raise ModelUnavailableError(
            f"open_clip {architecture}/{pretrained} is not in the local cache"
            f"{' and the machine is offline' if download else ''}: "
            f"download it on a machine with internet ({cfg.get('hf_hub') or cfg.get('url')}) or pass a local file"
        )
    try:
        with _download_timeout(20):
            return open_clip.download_pretrained(cfg)
    except Exception as err:
        raise ModelUnavailableError(
            f"open_clip {architecture}/{pretrained}: download failed ({type(err).__name__}); "
            "pass a local checkpoint file as teachers.joint.pretrained"
        ) from None


def describe_open_clip(architecture: str, pretrained: str) -> dict[str, Any]:
    """Cache-key description of an open_clip model (resolves the checkpoint, builds nothing)."""
    import open_clip

    checkpoint = resolve_open_clip(architecture, pretrained)
    described = {"model": f"open_clip/{architecture}", "pretrained": pretrained,
                 "config": open_clip.get_model_config(architecture), "open_clip": open_clip.__version__}
    if checkpoint:
        described |= {"file": Path(checkpoint).name, "bytes": Path(checkpoint).stat().st_size}
    return described


def load_open_clip(architecture: str, pretrained: str, download: bool = True):
    import open_clip

    checkpoint = resolve_open_clip(architecture, pretrained, download)
    model, _, preprocess = open_clip.create_model_and_transforms(architecture, pretrained=checkpoint)
    return model.eval(), preprocess, open_clip.get_tokenizer(architecture)


def open_clip_features(
    architecture: str, pretrained: str, captions: Sequence[str], image_files: Sequence[Path], batch_size: int,
    num_workers: int, device: torch.device, loaded: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """open_clip text and image features (e.g. ViT-L-14/openai, the KDMCSE/DALR code's teacher)."""
    model, preprocess, tokenizer = loaded or load_open_clip(architecture, pretrained)
    model = model.to(device)
    text_chunks, image_chunks = [], []
    with torch.inference_mode(), _autocast(device):
        for start in tqdm(range(0, len(captions), batch_size), desc=f"teacher {architecture}: text", unit="batch"):
            text_chunks.append(model.encode_text(tokenizer(list(captions[start : start + batch_size])).to(device)))
        for pixels in _image_batches(image_files, preprocess, batch_size, num_workers, f"teacher {architecture}"):
            image_chunks.append(model.encode_image(pixels.to(device)))
    return _normalised(text_chunks), _normalised(image_chunks)
