"""Errors that entry points turn into one clear line (importing this module loads no framework)."""


class PrecisionError(RuntimeError):
    """A precision the device cannot run (raised before any compute)."""


class TrainingOutOfMemory(RuntimeError):
    """The device ran out of memory during a training step (the resume point is untouched)."""


class CorruptArtifact(ValueError):
    """A stored artifact (feature store, checkpoint, image) that does not match its own header or
    the digest / size recorded for it; the message is one line: ``<path>: <problem>; <fix>``."""

    def __init__(self, path: object, problem: str, fix: str) -> None:
        super().__init__(path, problem, fix)  # all three in args: the error pickles (Prefect tasks)
        self.path, self.problem, self.fix = str(path), problem, fix

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}; {self.fix}"


class TrainingDiverged(RuntimeError):
    """A training step whose loss or gradient norm is not finite: training stops before any weight
    is saved (the last resume point, if any, is intact). The message is one line: step, value, likely
    cause."""


class StageError(RuntimeError):
    """A problem of what a stage runs on, not of its input: an output another process holds, a damaged
    or locked tracking store, a full disk, a server that did not start. One line: what, where, what to
    do; nothing is lost (the previous outputs and the last resume point stay)."""
