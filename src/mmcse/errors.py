"""Errors that entry points turn into one clear line (importing this module loads no framework)."""


class PrecisionError(RuntimeError):
    """A precision the device cannot run (raised before any compute)."""


class TrainingOutOfMemory(RuntimeError):
    """The device ran out of memory during a training step (the resume point is untouched)."""
