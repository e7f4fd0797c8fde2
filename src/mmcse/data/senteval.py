"""Readers for SentEval's ``data/downstream`` layout (STS12–16, STS-B, SICK).

Sentences are whitespace-normalised the way SentEval's batcher hands them to
SimCSE's evaluation (``' '.join(line.split())``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmcse.config.inputs import TRANSFER_TASKS
from mmcse.errors import InputError

STS_YEARS = ("STS12", "STS13", "STS14", "STS15", "STS16")
STS_TASKS = (*STS_YEARS, "STSBenchmark", "SICKRelatedness")


@dataclass(frozen=True)
class SentencePair:
    task: str
    subset: str
    s1: str
    s2: str
    score: float

    def to_row(self) -> dict:
        return {"task": self.task, "subset": self.subset, "s1": self.s1, "s2": self.s2, "score": self.score}

    @classmethod
    def from_row(cls, row: dict) -> SentencePair:
        return cls(row["task"], row["subset"], row["s1"], row["s2"], float(row["score"]))


def _norm(sentence: str) -> str:
    return " ".join(sentence.split())


def _downstream(root: str | Path) -> Path:
    root = Path(root)
    if (root / "downstream").is_dir():
        root = root / "downstream"
    return root


def _read_sts_year(folder: Path, task: str) -> list[SentencePair]:
    pairs = []
    inputs = sorted(folder.glob("STS.input.*.txt"))
    if not inputs:
        raise FileNotFoundError(f"{folder}: no STS.input.*.txt files")
    for input_path in inputs:
        subset = input_path.name[len("STS.input.") : -len(".txt")]
        gold_path = folder / f"STS.gs.{subset}.txt"
        if not gold_path.is_file():
            raise FileNotFoundError(f"{gold_path}: gold file missing for {input_path}")
        lines = input_path.read_text(encoding="utf8").splitlines()
        golds = gold_path.read_text(encoding="utf8").splitlines()
        if len(lines) != len(golds):
            raise InputError(f"{input_path}: {len(lines)} pairs but {gold_path.name} has {len(golds)} scores")
        for lineno, (line, gold) in enumerate(zip(lines, golds, strict=True), 1):
            if not gold.strip():  # SentEval skips pairs without a gold score
                continue
            cols = line.split("\t")
            if len(cols) < 2:
                raise InputError(f"{input_path}:{lineno}: expected two tab-separated sentences")
            pairs.append(SentencePair(task, subset, _norm(cols[0]), _norm(cols[1]), float(gold)))
    return pairs


def _read_stsb(path: Path, split: str) -> list[SentencePair]:
    pairs = []
    for lineno, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
        cols = line.strip().split("\t")
        if len(cols) < 7:
            raise InputError(f"{path}:{lineno}: expected 7 tab-separated columns, got {len(cols)}")
        pairs.append(SentencePair("STSBenchmark", split, _norm(cols[5]), _norm(cols[6]), float(cols[4])))
    return pairs


def _read_sick(path: Path, split: str) -> list[SentencePair]:
    pairs = []
    for lineno, line in enumerate(path.read_text(encoding="utf8").splitlines()[1:], 2):
        cols = line.strip().split("\t")
        if len(cols) < 4:
            raise InputError(f"{path}:{lineno}: expected >= 4 tab-separated columns")
        pairs.append(SentencePair("SICKRelatedness", split, _norm(cols[1]), _norm(cols[2]), float(cols[3])))
    return pairs


def available_sts_tasks(root: str | Path) -> list[str]:
    """The STS tasks whose files are present under ``root`` (in SentEval's order)."""
    down = _downstream(root)
    found = []
    for task in STS_YEARS:
        if (down / "STS" / f"{task}-en-test").is_dir():
            found.append(task)
    if (down / "STS" / "STSBenchmark" / "sts-test.csv").is_file():
        found.append("STSBenchmark")
    if (down / "SICK" / "SICK_test_annotated.txt").is_file():
        found.append("SICKRelatedness")
    return found


def read_sts_task(root: str | Path, task: str, split: str = "test") -> list[SentencePair]:
    """All scored pairs of one task; STS-B and SICK take ``split`` (train/dev/test)."""
    down = _downstream(root)
    if task in STS_YEARS:
        return _read_sts_year(down / "STS" / f"{task}-en-test", task)
    if task == "STSBenchmark":
        return _read_stsb(down / "STS" / "STSBenchmark" / f"sts-{split}.csv", split)
    if task == "SICKRelatedness":
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        return _read_sick(down / "SICK" / name, split)
    raise InputError(f"unknown STS task {task!r}; known: {', '.join(STS_TASKS)}")


def read_sts_tasks(root: str | Path) -> dict[str, list[SentencePair]]:
    """Every STS task present under ``root`` (test splits); missing tasks are omitted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: SentEval folder not found")
    tasks = available_sts_tasks(root)
    if not tasks:
        raise FileNotFoundError(
            f"{root}: no SentEval STS data (expected downstream/STS/STS12-en-test/…, "
            "downstream/STS/STSBenchmark/sts-test.csv or downstream/SICK/SICK_test_annotated.txt)"
        )
    return {task: read_sts_task(root, task) for task in tasks}


# --- transfer tasks ---------------------------------------------------------------------------

# Two files each (SentEval's BinaryClassifierEval): label 1 for the first, 0 for the second.
_BINARY_FILES = {
    "MR": ("MR", "rt-polarity.pos", "rt-polarity.neg"),
    "CR": ("CR", "custrev.pos", "custrev.neg"),
    "SUBJ": ("SUBJ", "subj.objective", "subj.subjective"),
    "MPQA": ("MPQA", "mpqa.pos", "mpqa.neg"),
}
TREC_CLASSES = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")


@dataclass(frozen=True)
class TransferExample:
    """One labelled example of a transfer task; ``text2`` only for sentence pairs (MRPC)."""

    task: str
    split: str  # all (cross-validated: MR, CR, SUBJ, MPQA) | train | dev | test
    text: str
    label: int
    text2: str | None = None

    def to_row(self) -> dict:
        row = {"task": self.task, "split": self.split, "text": self.text, "label": self.label}
        if self.text2 is not None:
            row["text2"] = self.text2
        return row

    @classmethod
    def from_row(cls, row: dict) -> TransferExample:
        return cls(row["task"], row["split"], row["text"], int(row["label"]), row.get("text2"))


def _transfer_files(down: Path, task: str) -> list[Path]:
    if task in _BINARY_FILES:
        folder, first, second = _BINARY_FILES[task]
        return [down / folder / first, down / folder / second]
    if task == "SST2":
        return [down / "SST" / "binary" / f"sentiment-{split}" for split in ("train", "dev", "test")]
    if task == "TREC":
        return [down / "TREC" / "train_5500.label", down / "TREC" / "TREC_10.label"]
    if task == "MRPC":
        return [down / "MRPC" / "msr_paraphrase_train.txt", down / "MRPC" / "msr_paraphrase_test.txt"]
    raise InputError(f"unknown transfer task {task!r}; known: {', '.join(TRANSFER_TASKS)}")


def available_transfer_tasks(root: str | Path) -> list[str]:
    """The transfer tasks whose files are all present under ``root`` (SentEval's order)."""
    down = _downstream(root)
    return [t for t in TRANSFER_TASKS if all(p.is_file() for p in _transfer_files(down, t))]


def _lines(path: Path, encoding: str) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: SentEval transfer-task file missing")
    return path.read_text(encoding=encoding).splitlines()


def read_transfer_task(root: str | Path, task: str) -> list[TransferExample]:
    """Every example of one transfer task, in file order, read as SentEval reads it
    (latin-1 for the binary tasks and TREC, UTF-8 for SST and MRPC; whitespace-normalised)."""
    down = _downstream(root)
    files = _transfer_files(down, task)
    examples: list[TransferExample] = []
    if task in _BINARY_FILES:
        for path, label in zip(files, (1, 0), strict=True):
            examples += [TransferExample(task, "all", _norm(line), label) for line in _lines(path, "latin-1")]
    elif task == "SST2":
        for path, split in zip(files, ("train", "dev", "test"), strict=True):
            for lineno, line in enumerate(_lines(path, "utf-8"), 1):
                cols = line.strip().split("\t")
                if len(cols) != 2 or cols[1] not in ("0", "1"):
                    raise InputError(f"{path}:{lineno}: expected 'sentence<TAB>0|1'")
                examples.append(TransferExample(task, split, _norm(cols[0]), int(cols[1])))
    elif task == "TREC":
        for path, split in zip(files, ("train", "test"), strict=True):
            for lineno, line in enumerate(_lines(path, "latin-1"), 1):
                target, _, rest = line.strip().partition(":")
                if target not in TREC_CLASSES or " " not in rest:
                    raise InputError(f"{path}:{lineno}: expected 'CLASS:fine question' with CLASS in "
                                     f"{', '.join(TREC_CLASSES)}")
                question = rest.split(" ", 1)[1]  # drop the fine-grained label
                examples.append(TransferExample(task, split, _norm(question), TREC_CLASSES.index(target)))
    else:  # MRPC: header line, then Quality, #1 ID, #2 ID, #1 String, #2 String
        for path, split in zip(files, ("train", "test"), strict=True):
            for lineno, line in enumerate(_lines(path, "utf-8-sig")[1:], 2):
                cols = line.strip().split("\t")
                if len(cols) != 5 or cols[0] not in ("0", "1"):
                    raise InputError(f"{path}:{lineno}: expected 5 tab-separated columns starting with 0|1")
                examples.append(TransferExample(task, split, _norm(cols[3]), int(cols[0]), _norm(cols[4])))
    return examples
