"""VSE++'s loss (Faghri et al., BMVC 2018, Eq. 5): the max-violation hinge summed over the batch, the
same function as DUET Eq. 28–29. The model is :mod:`mmcse.models.vsepp`."""

from __future__ import annotations

import torch

from mmcse.methods.duet import max_violation_hinge


def vsepp_objective(v_img: torch.Tensor, v_txt: torch.Tensor, margin: float = 0.2,
                    ignore: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """VSE++ Eq. 5 (max violation, "MH"), summed over the batch: ``{"hinge", "loss"}`` (one term)."""
    hinge = max_violation_hinge(v_img, v_txt, margin=margin, reduction="sum", ignore=ignore)
    return {"hinge": hinge, "loss": hinge}
