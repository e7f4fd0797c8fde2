"""The papers' printed numbers as data: ``papers/<paper>.yaml``.

A paper file lists its numbered tables and figures (``table<N>`` / ``fig<N>``). Each names the
ablation preset that reproduces it (``<paper>-table<N>``, a file in ``ablations/``), its columns
(the paper's header -> the metric a job reports, e.g. ``STS-B: STSBenchmark``) and its cells in
*blocks*: one per training context a profile sets, keyed ``<data>-<encoder>`` (``flickr-bert``) or
``<data>`` (DUET), the part of a profile name after the paper (``kdmcse-flickr-bert``). A block maps
each row, named as the preset's variant, to the printed cells::

    MCSE: {line: 176, label: MCSE-BERT ◇, cells: [71.4±0.9, 81.8±1.3, …]}

``line`` is the line (or lines, concatenated) of the paper's text copy the cells are read from, so a
test can check every number against it (`check_against_text`); ``ocr`` maps a value to how the copy
misprints it (``{74.0: /4.0}``). A cell is printed ``mean``, ``mean±std`` or ``mean*±std`` (``*``:
the paper's significance marker), or null where the paper prints nothing. A paper with two text
copies names the second (``second_text``); a row whose markers the second copy prints differently
records them (``second_copy: {line: N, marked: [the headers it marks]}``), both copies' markers
are checked against their lines (`check_marks`), and the report marks those cells (``†``). A row the preset cannot
produce says why (``not_reproduced``); a row of differences names its two rows (``difference:
[DALR, KDMCSE]``). Tables whose copy scrambles the cells' order say ``order: scrambled``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from mmcse.config import ConfigError
from mmcse.config.declared import SECTION, Int, PositiveInt, Str, build
from mmcse.evaluation.evaluators import any_evaluator_writes
from mmcse.evaluation.names import score_key
from mmcse.io import load_yaml
from mmcse.runstore import TRAIN_MINUTES

PAPERS_DIR = "papers"
PAPERS = ("dalr", "kdmcse", "mcseo", "duet")
TABLE_KEY = re.compile(r"(table|fig)(\d+)")
CELL = re.compile(r"([-+]?\d+(?:\.\d+)?)(\*?)(?:±(\d+(?:\.\d+)?))?")
# the numbers of a line of the text copy: a decimal comma is what the copy printed, kept as printed
PRINTED_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)?")
# a printed ``mean ± std`` cell of a text copy and what follows it up to the next space: ``74.4* \pm 1.4``
# (kdmcse.txt) or ``74.4±1.4subscriptsuperscript…{}^{*}…`` (kdmcse-2.txt's LaTeX residue, the marker in it)
PRINTED_CELL = re.compile(r"(\d+(?:\.\d+)?)(\*?)\s*(?:±|\\pm)\s*\d+(?:\.\d+)?(\S*)")

def known_metric(name: str) -> bool:
    """A score some registered evaluator writes (`mmcse.evaluation.evaluators.any_evaluator_writes`), or a job's
    training minutes."""
    return name == TRAIN_MINUTES or any_evaluator_writes(name)


@dataclass(frozen=True)
class Cell:
    """One printed cell: ``mean`` (None: the paper prints nothing), ``std``, the significance marker."""

    printed: str | None
    mean: float | None
    std: float | None = None
    marked: bool = False

    @classmethod
    def parse(cls, value: Any, where: str) -> Cell:
        if value is None:
            return cls(None, None)
        text = str(value).strip()
        m = CELL.fullmatch(text)
        if m is None:
            raise ConfigError(f"{where}: cell {text!r} is not 'mean', 'mean±std' or 'mean*±std'")
        return cls(text, float(m.group(1)), float(m.group(3)) if m.group(3) else None, bool(m.group(2)))

    @property
    def resolution(self) -> float:
        """The unit of the printed mean's last digit: 0.1 for '76.3', 0.01 for '76.25', 1 for '76' (0: nothing
        printed). The printed number stands for ± half of it (`mmcse.analysis.statistics.printed_interval`)."""
        numbers = self.numbers()
        if not numbers:
            return 0.0
        decimals = len(numbers[0].split(".")[1]) if "." in numbers[0] else 0
        return 10.0 ** -decimals

    def numbers(self) -> list[str]:
        """The numbers as printed, in order (mean, then std)."""
        if self.printed is None:
            return []
        m = CELL.fullmatch(self.printed)
        assert m is not None
        return [m.group(1)] + ([m.group(3)] if m.group(3) else [])


@dataclass(frozen=True)
class PaperRow:
    variant: str
    label: str
    lines: tuple[int, ...]
    cells: tuple[Cell, ...]
    ocr: dict[str, str] = field(default_factory=dict)
    not_reproduced: str = ""
    difference: tuple[str, str] | None = None
    second_line: int | None = None  # the row's line in the paper's second text copy
    second_marked: tuple[bool, ...] | None = None  # that copy's significance markers, one per cell

    def copies_differ(self, i: int) -> bool:
        """Whether the two text copies mark cell ``i`` differently."""
        return self.second_marked is not None and self.second_marked[i] != self.cells[i].marked


@dataclass(frozen=True)
class PaperTable:
    key: str  # table3 / fig7
    title: str
    source: str
    preset: str
    columns: dict[str, str]  # the paper's header -> the metric
    blocks: dict[str, dict[str, PaperRow]]
    order: str = "printed"
    runs: int | None = None  # how many runs each printed mean ± std is over (None: the paper does not say)
    # metric -> (σ, cells): the reproduction tolerance of a printed number without a std (`reproduction_tolerances`)
    tolerances: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "figure" if self.key.startswith("fig") else "table"

    @property
    def number(self) -> int:
        m = TABLE_KEY.fullmatch(self.key)
        assert m is not None
        return int(m.group(2))

    @property
    def name(self) -> str:
        return f"{'Figure' if self.kind == 'figure' else 'Table'} {self.number}"


@dataclass(frozen=True)
class Paper:
    name: str  # dalr
    title: str
    text: str  # the text copy's file name (under ../shared/papers)
    tables: dict[str, PaperTable]
    file: Path
    second_text: str | None = None  # a second copy of the paper whose markers some rows record


# A paper file as declared: keys, types and bounds checked by pydantic (`mmcse.config.declared.build`: one line
# naming the file and the dotted key); what spans keys (cells per column, a preset per table, known metrics,
# rows a difference names) is checked as the file becomes a `Paper`.
@dataclass(frozen=True)
class _SecondCopy:
    __pydantic_config__ = SECTION
    line: PositiveInt
    marked: list[Str]  # column headers the second copy marks significant


@dataclass(frozen=True)
class _RowEntry:
    __pydantic_config__ = SECTION
    line: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)]
    label: Str
    cells: list[Any]
    ocr: dict[str, Any] = field(default_factory=dict)
    not_reproduced: Str = ""
    difference: Annotated[list[Str], Field(min_length=2, max_length=2)] | None = None
    second_copy: _SecondCopy | None = None


@dataclass(frozen=True)
class _TableEntry:
    __pydantic_config__ = SECTION
    preset: Str
    title: Str = ""
    source: Str = ""
    columns: dict[str, Str] = field(default_factory=dict)
    blocks: dict[str, dict[str, _RowEntry]] = field(default_factory=dict)
    order: Literal["printed", "scrambled"] = "printed"
    runs: Annotated[Int, Field(ge=2)] | None = None  # runs behind a printed mean ± std


@dataclass(frozen=True)
class _PaperFile:
    __pydantic_config__ = SECTION
    paper: Str = ""
    text: Str = ""
    second_text: Str | None = None
    tables: dict[str, _TableEntry] = field(default_factory=dict)


def _row(variant: str, entry: _RowEntry, columns: list[str], where: str) -> PaperRow:
    if len(entry.cells) != len(columns):
        raise ConfigError(f"{where}: cells must list one value per column ({len(columns)}), got {entry.cells!r}")
    second = entry.second_copy
    if second is not None and not set(second.marked) <= set(columns):
        raise ConfigError(f"{where}.second_copy: marked must list column headers (of {', '.join(columns)}), "
                          f"got {second.marked!r}")
    return PaperRow(variant, entry.label, tuple(entry.line if isinstance(entry.line, list) else [entry.line]),
                    tuple(Cell.parse(c, where) for c in entry.cells), {str(k): str(v) for k, v in entry.ocr.items()},
                    entry.not_reproduced, tuple(entry.difference) if entry.difference else None,
                    second.line if second else None, tuple(c in second.marked for c in columns) if second else None)


def _table(paper: str, key: str, entry: _TableEntry, where: str) -> PaperTable:
    if TABLE_KEY.fullmatch(key) is None:
        raise ConfigError(f"{where}: a table key is table<N> or fig<N>, got {key!r}")
    if entry.preset != f"{paper}-{key}":
        raise ConfigError(f"{where}: preset must be {paper}-{key} (one preset per numbered table), "
                          f"got {entry.preset!r}")
    columns = {k: score_key(v) for k, v in entry.columns.items()}
    unknown = [m for m in columns.values() if not known_metric(m)]
    if unknown:
        raise ConfigError(f"{where}.columns: {unknown} are not metrics a job reports")
    if entry.blocks and not columns:
        raise ConfigError(f"{where}: cells need columns")
    blocks: dict[str, dict[str, PaperRow]] = {}
    for block, rows in entry.blocks.items():
        blocks[block] = {v: _row(v, r, list(columns), f"{where}.blocks.{block}.{v}") for v, r in rows.items()}
        for row in blocks[block].values():
            missing = [v for v in row.difference or () if v not in blocks[block]]
            if missing:
                raise ConfigError(f"{where}.blocks.{block}.{row.variant}: difference names {missing}, not rows of "
                                  "the block")
    return PaperTable(key, entry.title or key, entry.source, entry.preset, columns, blocks, entry.order, entry.runs)


def load_paper(name: str, root: Path | str = ".") -> Paper:
    """``papers/<name>.yaml`` under ``root``, checked: one line naming the file and key on error."""
    file = Path(root) / PAPERS_DIR / f"{name}.yaml"
    if name not in list_papers(root):  # a name, not a path: nothing outside papers/ is read
        raise ConfigError(f"no paper file {file}; papers: {', '.join(list_papers(root)) or 'none'}")
    declared = build(_PaperFile, load_yaml(file.read_text(encoding="utf-8")) or {}, str(file))
    tables = {k: _table(name, k, t, f"{file}: tables.{k}") for k, t in declared.tables.items()}
    return Paper(name, declared.paper or name, declared.text or f"{name}.txt", tables, file, declared.second_text)


def reproduction_tolerances(papers: Iterable[Paper]) -> dict[str, tuple[float, int]]:
    """Per metric, the papers' own run-to-run noise: the root mean square of every std the ``papers`` print for it
    (a cell ``mean±std``, std > 0), and how many cells it is from. It stands in for a printed number's noise where
    a table prints none (`mmcse.analysis.statistics.reproduction_verdict`'s ``prior_std``); a metric no paper
    prints a std for has none."""
    squares: dict[str, list[float]] = {}
    for paper in papers:
        for table in paper.tables.values():
            metrics = list(table.columns.values())
            for rows in table.blocks.values():
                for row in rows.values():
                    for metric, cell in zip(metrics, row.cells, strict=True):
                        if cell.std is not None and cell.std > 0:
                            squares.setdefault(metric, []).append(cell.std ** 2)
    return {m: (math.sqrt(sum(v) / len(v)), len(v)) for m, v in sorted(squares.items())}


def with_tolerances(paper: Paper, tolerances: dict[str, tuple[float, int]]) -> Paper:
    """``paper`` with each table carrying the tolerances of its metrics (`reproduction_tolerances`)."""
    tables = {k: dataclasses.replace(t, tolerances={m: tolerances[m] for m in t.columns.values() if m in tolerances})
              for k, t in paper.tables.items()}
    return dataclasses.replace(paper, tables=tables)


def list_papers(root: Path | str = ".") -> list[str]:
    folder = Path(root) / PAPERS_DIR
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def printed_numbers(line: str) -> list[str]:
    return PRINTED_NUMBER.findall(line)


def check_against_text(paper: Paper, text: str) -> list[str]:
    """Every transcribed number against the paper's text copy: the cells of a row, each as the copy
    prints it (``ocr``), are found in its line(s) in order (``order: scrambled``: each somewhere in
    them). Returns one message per row that does not match (empty: all match)."""
    lines = text.splitlines()
    problems = []
    for table in paper.tables.values():
        for block, rows in table.blocks.items():
            for row in rows.values():
                where = f"{paper.file}: tables.{table.key}.blocks.{block}.{row.variant}"
                if max(row.lines) > len(lines):
                    problems.append(f"{where}: line {max(row.lines)} is past the end of {paper.text}")
                    continue
                found = [n for i in row.lines for n in printed_numbers(lines[i - 1])]
                wanted = [row.ocr.get(n, n) for c in row.cells for n in c.numbers()]
                if table.order == "scrambled":
                    missing = [n for n in wanted if n not in found]
                else:  # in order: each number after the previous one's place (the line may print more)
                    missing, place = [], 0
                    for n in wanted:
                        if n in found[place:]:
                            place = found.index(n, place) + 1
                        else:
                            missing.append(n)
                if missing:
                    problems.append(f"{where}: {missing} not in line(s) {list(row.lines)} of {paper.text} "
                                    f"(it prints {found})")
    return problems


def printed_marks(line: str) -> list[bool]:
    """The significance marker of each ``mean ± std`` cell a line of a text copy prints, in order."""
    return [bool(star) or "{}^{*}" in tail for _, star, tail in PRINTED_CELL.findall(line)]


def check_marks(paper: Paper, text: str, second: str) -> list[str]:
    """The markers of every row that records the second copy's: its cells' ``*`` against its line in
    ``text`` (the paper's copy), its ``second_copy.marked`` against its line in ``second``. Returns one
    message per disagreement (empty: both copies read as recorded)."""
    copies = {"text": text.splitlines(), "second": second.splitlines()}
    problems = []
    for table in paper.tables.values():
        for block, rows in table.blocks.items():
            for row in rows.values():
                if row.second_line is None or row.second_marked is None:
                    continue
                where = f"{paper.file}: tables.{table.key}.blocks.{block}.{row.variant}"
                for copy, name, line, marked in (
                        ("text", paper.text, row.lines[0], tuple(c.marked for c in row.cells)),
                        ("second", paper.second_text, row.second_line, row.second_marked)):
                    printed = printed_marks(copies[copy][line - 1]) if line <= len(copies[copy]) else []
                    if tuple(printed) != marked:
                        problems.append(f"{where}: line {line} of {name} marks {printed}, recorded {list(marked)}")
    return problems
