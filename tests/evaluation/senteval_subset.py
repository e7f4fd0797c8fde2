"""A SentEval folder cut to every k-th item of every file the evaluate stage reads, in SentEval's own layout, so a
test touches every task, file format and code path of the real data at a fraction of its cost."""

from __future__ import annotations

from pathlib import Path

# per file: how many leading lines are a header (always kept)
STS_YEARS = ("STS12", "STS13", "STS14", "STS15", "STS16")
HEADERS = {"STS/STSBenchmark/sts-test.csv": 0, "STS/STSBenchmark/sts-dev.csv": 0, "SICK/SICK_test_annotated.txt": 1,
           "TREC/train_5500.label": 0, "TREC/TREC_10.label": 0,
           "MRPC/msr_paraphrase_train.txt": 1, "MRPC/msr_paraphrase_test.txt": 1}


def _every(lines: list[str], every: int, header: int) -> list[str]:
    return lines[:header] + lines[header:][::every]


def _cut(source: Path, target: Path, every: int, header: int, encoding: str) -> None:
    # split as the readers split (str.splitlines on the decoded text), so a kept line is a whole record
    lines = source.read_text(encoding=encoding).splitlines()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(_every(lines, every, header)) + "\n", encoding=encoding)


def senteval_subset(source: Path, target: Path, every: int = 20, transfer_every: int = 10) -> Path:
    """``target``/downstream with every ``every``-th pair of the seven STS tasks (each STS12–16 subset's input and
    gold files cut at the same lines; STS-B's dev split, the stage's dev set, too; the smallest subset, STS13's
    FNWN, keeps 10 pairs at 20) and every ``transfer_every``-th example of TREC and MRPC (headers kept: a probe
    trained on fewer is too weak to hold against the majority class)."""
    down, out = source / "downstream", target / "downstream"
    for year in STS_YEARS:
        folder = down / "STS" / f"{year}-en-test"
        for gold in sorted(folder.glob("STS.gs.*.txt")):
            subset = gold.name[len("STS.gs."):-len(".txt")]
            pair = folder / f"STS.input.{subset}.txt"
            if not pair.is_file():  # STS12's STS.gs.ALL.txt: a concatenation the reader does not read
                continue
            for path in (pair, gold):
                _cut(path, out / "STS" / folder.name / path.name, every, 0, "utf8")
    for name, header in HEADERS.items():
        encoding = "latin-1" if name.startswith("TREC") else "utf8"
        _cut(down / name, out / name, every if name.startswith(("STS", "SICK")) else transfer_every, header, encoding)
    return target
