"""The torchvision ResNets mmcse reads images with (MCSE's ResNet-50 teacher, VSE++'s ResNet-152), as
one architecture: no classifier, the pooled feature out."""

from __future__ import annotations

from torch import nn

RESNETS = {"resnet50": "ResNet50", "resnet101": "ResNet101", "resnet152": "ResNet152"}  # torchvision's names
RESNET_WIDTH = 2048  # the pooled feature of each of RESNETS


def pooled_resnet(arch: str) -> nn.Module:
    """torchvision's ``arch`` (one of `RESNETS`) with random weights and no classifier: ``(B, 3, H, W)``
    → its pooled ``(B, 2048)`` feature (VSE++'s ``cnn.module.fc = nn.Sequential()``)."""
    import torchvision

    if arch not in RESNETS:
        raise ValueError(f"{arch!r} is not one of {sorted(RESNETS)}")
    model = getattr(torchvision.models, arch)(weights=None)
    model.fc = nn.Identity()
    return model
