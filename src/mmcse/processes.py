"""Which process of a training job this is, read from the environment torchrun gives the processes it starts
(no torch import: every entry point asks, before torch's seconds of loading)."""

from __future__ import annotations

import os

NODE_RANK = "MMCSE_NODE_RANK"  # this machine's place among train.nodes (0: the one that writes the outputs)


def launched() -> bool:
    """Whether torchrun started this process (it sets ``LOCAL_RANK`` and ``WORLD_SIZE``)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def lead() -> bool:
    """Whether this process writes the job's outputs: rank 0, or a process torchrun did not start."""
    return int(os.environ.get("RANK", "0")) == 0 if launched() else True


def holds_outputs() -> bool:
    """Whether this process holds a stage's outputs while it runs: not one torchrun started (its launcher
    holds them) nor one on a machine other than the one that writes them (``MMCSE_NODE_RANK`` > 0)."""
    return not launched() and os.environ.get(NODE_RANK, "0").strip() in ("0", "")
