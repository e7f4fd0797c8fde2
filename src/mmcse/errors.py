"""Every error class of mmcse, in one place: entry points turn each into one clear line (importing
this module loads no framework)."""


class InputError(ValueError):
    """What a user gave that cannot be used: a file or data set in the wrong shape, a value or option out of
    range, a checkpoint from another configuration. The message is one line naming the file or option and
    what to do; an entry point prints that line alone (a ``ValueError`` of any other class is a bug in mmcse:
    its traceback is printed too)."""


class MissingEntry(InputError, KeyError):
    """An id or name a user's files or arguments lack (an image row, a cached feature, an MLflow run): a
    ``KeyError`` for the code that looks it up, one line for the user (no quotes around it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PrecisionError(RuntimeError):
    """A precision the device cannot run (raised before any compute)."""


class TrainingOutOfMemory(RuntimeError):
    """The device ran out of memory during a training step (the resume point is untouched)."""


class CorruptArtifact(InputError):
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


class StoppedEarly(Exception):
    """Raised by a training's ``on_eval`` hook to end it as planned at a dev evaluation (a pruned sweep
    trial): the loop writes the best checkpoint so far and a resume point before it propagates, and the
    MLflow run ends FINISHED, not FAILED (`mmcse.tracking.run` reads ``mlflow_status``). The loop sets
    ``best_score`` and ``best_step``: the checkpoint it wrote (the initial evaluation's, step 0, included)."""

    mlflow_status = "FINISHED"
    best_score: float = float("nan")
    best_step: int = -1


class StageError(RuntimeError):
    """A problem of what a stage runs on, not of its input: an output another process holds, a damaged
    or locked tracking store, a full disk, a server that did not start. One line: what, where, what to
    do; nothing is lost (the previous outputs and the last resume point stay)."""


class ConfigError(InputError):
    """A params file or override that cannot be turned into a valid config."""


class ModelUnavailableError(RuntimeError):
    """A model id that cannot be loaded here (offline, not cached, or misspelt)."""


class DownloadError(RuntimeError):
    """A download or archive that cannot be used; the message names the source and why."""


class TokenCacheError(InputError):
    """A token cache folder that does not match its header (truncated or foreign files)."""


class MTEBTaskError(InputError):
    """A task name that is neither an mteb task nor a task type of :data:`TABLE5_TYPES`."""


class MTEBDataMissing(FileNotFoundError):
    """A task's data set is not in the local Hugging Face cache and cannot be downloaded."""


class SpiceUnavailable(RuntimeError):
    """SPICE relevance cannot run here (raised before any compute, naming what to install)."""


# What a user can fix: an entry point prints the message alone and exits 2 (`mmcse.entry`); any other exception
# is a bug in mmcse and prints its traceback before that line.
USER_ERRORS: tuple[type[BaseException], ...] = (
    InputError, ModelUnavailableError, DownloadError, FileNotFoundError, PrecisionError, TrainingOutOfMemory,
    TrainingDiverged, StageError, SpiceUnavailable,
)
