"""papers/<paper>.yaml: the papers' printed numbers, checked against the papers' text copies and
against the presets that reproduce them."""

import os
import re
from pathlib import Path

import pytest

from mmcse.analysis.papers import PAPERS, Cell, check_against_text, check_marks, list_papers, load_paper
from mmcse.analysis.report import block_grid
from mmcse.config import ConfigError
from mmcse.experiments.params import load_config
from tests.conftest import REPO

PAPER_TEXTS = Path(os.environ.get("MMCSE_PAPERS_DIR", REPO.parent / "shared" / "papers"))
# Numbered figures that are illustrations (examples, architecture): no preset reproduces them.
ILLUSTRATIONS = {"dalr": {1, 2}, "kdmcse": {1, 2, 3, 4}, "mcseo": {1, 2}, "duet": {1}}


def _text(paper) -> str:
    path = PAPER_TEXTS / paper.text
    if not path.is_file():
        pytest.skip(f"no paper text copy at {path}")
    return path.read_text(encoding="utf-8")


def test_every_paper_has_its_numbers_file():
    assert list_papers(REPO) == sorted(PAPERS)


@pytest.mark.parametrize("name", PAPERS)
def test_every_transcribed_number_is_printed_in_its_line_of_the_paper(name):
    paper = load_paper(name, REPO)
    assert check_against_text(paper, _text(paper)) == []


def test_kdmcse_table1_records_both_copies_significance_markers():
    """kdmcse.txt and kdmcse-2.txt mark three Table 1 cells differently: each copy's markers as recorded, and
    the three cells (and only they) flagged for the report."""
    paper = load_paper("kdmcse", REPO)
    second = PAPER_TEXTS / str(paper.second_text)
    if not second.is_file():
        pytest.skip(f"no second text copy at {second}")
    assert check_marks(paper, _text(paper), second.read_text(encoding="utf-8")) == []
    table = paper.tables["table1"]
    differ = {(block, row.variant, header) for block, rows in table.blocks.items() for row in rows.values()
              for i, header in enumerate(table.columns) if row.copies_differ(i)}
    assert differ == {("flickr-bert", "KDMCSE", "STS15"), ("coco-roberta", "KDMCSE", "STS14"),
                      ("coco-roberta", "KDMCSE", "STS15")}
    _, grid = block_grid(table, table.blocks["flickr-bert"], None)
    assert next(r for r in grid if r[0] == "KDMCSE")[2:] == [
        "74.4*±1.4", "83.1*±0.9", "76.3*±1.1", "83.7*±0.8†", "78.8*±0.9", "81.3*±0.9", "73.0*±0.9", "78.6*±0.8"]


def test_the_marker_check_reads_both_copies_formats(tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers/p.yaml").write_text(
        "text: p.txt\nsecond_text: p2.txt\ntables:\n  table1:\n    preset: p-table1\n"
        "    columns: {STS12: STS12, Avg.: avg}\n    blocks:\n      flickr-bert:\n"
        "        A: {line: 1, label: A, cells: [70.1*±0.5, 80.2±0.3], second_copy: {line: 1, marked: [Avg.]}}\n")
    paper = load_paper("p", tmp_path)
    first = "A\t70.1* \\pm 0.5\t80.2 \\pm 0.3\n"
    latex = "A 70.1±0.5 80.2±0.3subscriptsuperscriptabsentplus-or-minus0.3{}^{*}_{\\pm 0.3}start_FLOATSUPERSCRIPT ∗\n"
    assert check_marks(paper, first, latex) == []
    assert [paper.tables["table1"].blocks["flickr-bert"]["A"].copies_differ(i) for i in (0, 1)] == [True, True]
    problems = check_marks(paper, first.replace("70.1*", "70.1"), latex.replace("{}^{*}", ""))
    assert len(problems) == 2 and "line 1 of p.txt marks [False, False], recorded [True, False]" in problems[0]
    assert "line 1 of p2.txt marks [False, False], recorded [False, True]" in problems[1]


@pytest.mark.parametrize("name", PAPERS)
def test_every_numbered_table_and_figure_of_the_paper_is_listed(name):
    """Captions in the text copy ("Table 3:", "Figure 8:", DUET's "Table 1.") against the file's keys."""
    paper = load_paper(name, REPO)
    text = _text(paper)
    tables = {int(n) for n in re.findall(r"^Table (\d+)[:.]", text, re.M)}
    figures = {int(n) for n in re.findall(r"^Figure (\d+)[:.]", text, re.M)} - ILLUSTRATIONS[name]
    assert {t.number for t in paper.tables.values() if t.kind == "table"} == tables
    assert {t.number for t in paper.tables.values() if t.kind == "figure"} == figures


def test_the_check_finds_a_wrong_number_and_a_missing_misprint(tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers/p.yaml").write_text(
        "text: p.txt\ntables:\n  table1:\n    preset: p-table1\n    columns: {Avg.: avg, STS-B: STSBenchmark}\n"
        "    blocks:\n      flickr-bert:\n        A: {line: 2, label: A, cells: [70.1±0.5, '80.2']}\n"
        "        B: {line: 3, label: B, cells: [74.0±1.0, '81.0'], ocr: {'74.0': '4.0'}}\n")
    good = "Model Avg. STS-B\nA 70.1 ± 0.5 80.2\nB /4.0 ± 1.0 81.0\n"
    paper = load_paper("p", tmp_path)
    assert check_against_text(paper, good) == []
    problems = check_against_text(paper, good.replace("80.2", "80.3"))
    assert len(problems) == 1 and "tables.table1.blocks.flickr-bert.A: ['80.2'] not in line(s) [2]" in problems[0]
    # the cells must come in the printed order
    assert check_against_text(paper, good.replace("A 70.1 ± 0.5 80.2", "A 80.2 70.1 ± 0.5")) != []
    # without its ocr entry the misprinted 74.0 is not found
    file = tmp_path / "papers/p.yaml"
    file.write_text(file.read_text().replace(", ocr: {'74.0': '4.0'}", ""))
    assert "['74.0'] not in line(s) [3]" in check_against_text(load_paper("p", tmp_path), good)[0]


@pytest.mark.parametrize(("text", "error"), [
    ("tables:\n  table1: {preset: p-table1, colour: red}\n",
     r"unknown key\(s\) tables.table1.colour; valid keys under tables.table1: preset, title"),
    ("tables:\n  table1: {preset: p-table1, order: shuffled}\n",
     r"key 'tables.table1.order': must be one of \['printed', 'scrambled'\]"),
    ("tables:\n  table1: {preset: p-table1, runs: 1}\n", r"key 'tables.table1.runs': must be >= 2"),
    ("tables:\n  table1:\n    preset: p-table1\n    columns: {Avg.: avg}\n    blocks: {b: {A: {line: 0, label: A, "
     "cells: ['1.0']}}}\n", r"key 'tables.table1.blocks.b.A.line': must be"),
    ("tables:\n  table1: {preset: p-table2}\n", "preset must be p-table1"),
    ("tables:\n  tab1: {preset: p-tab1}\n", "table<N> or fig<N>"),
    ("tables:\n  table1: {preset: p-table1, columns: {X: sts_average}}\n", r"\['sts_average'\] are not metrics"),
    ("tables:\n  table1:\n    preset: p-table1\n    columns: {Avg.: avg}\n    blocks: {b: {A: {line: 1, label: A, "
     "cells: ['1.0', '2.0']}}}\n", r"cells must list one value per column \(1\)"),
    ("tables:\n  table1:\n    preset: p-table1\n    columns: {Avg.: avg}\n    blocks: {b: {A: {line: 1, label: A, "
     "cells: [1.0 +- 2]}}}\n", "is not 'mean', 'mean±std'"),
    ("tables:\n  table1:\n    preset: p-table1\n    columns: {Avg.: avg}\n    blocks: {b: {D: {line: 1, label: D, "
     "cells: ['+1.0'], difference: [A, B]}}}\n", r"difference names \['A', 'B'\], not rows"),
])
def test_a_bad_paper_file_is_one_line_naming_file_and_key(tmp_path, text, error):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers/p.yaml").write_text(text)
    with pytest.raises(ConfigError, match=error) as err:
        load_paper("p", tmp_path)
    assert str(tmp_path / "papers/p.yaml") in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no paper file .*papers: p"):
        load_paper("q", tmp_path)


def test_cells_parse_as_printed():
    assert Cell.parse("74.4*±1.4", "w") == Cell("74.4*±1.4", 74.4, 1.4, True)
    assert Cell.parse("-2.350", "w") == Cell("-2.350", -2.35, None, False)
    assert Cell.parse("+0.85", "w").mean == 0.85 and Cell.parse(None, "w").mean is None
    assert Cell.parse("290", "w").numbers() == ["290"] and Cell.parse("67.8±1.6", "w").numbers() == ["67.8", "1.6"]


def _preset_rows(preset: str) -> list[str] | None:
    if not (REPO / "ablations" / f"{preset}.yaml").is_file():
        return None
    return list(load_config(REPO / "params.yaml", {"ablate.preset": preset}).ablate.variants)


@pytest.mark.parametrize("name", PAPERS)
def test_every_preset_row_has_its_paper_row_and_every_paper_row_its_preset_row(name):
    """Each paper row is a preset variant (unless it says why not, or is a difference of two rows),
    and each variant of the table's preset is a row of some block; tables whose preset does not
    exist yet are the report's "no preset yet"."""
    paper = load_paper(name, REPO)
    for table in paper.tables.values():
        rows = _preset_rows(table.preset)
        if rows is None or not table.blocks:
            continue
        printed = {v for block in table.blocks.values() for v, r in block.items()
                   if not r.not_reproduced and not r.difference}
        assert printed <= set(rows), (table.key, sorted(printed - set(rows)))
        assert set(rows) <= printed, (table.key, sorted(set(rows) - printed))
        for block in table.blocks.values():  # a row the preset lacks says why
            for row in block.values():
                assert row.variant in rows or row.not_reproduced or row.difference, (table.key, row.variant)


@pytest.mark.parametrize("name", PAPERS)
def test_every_table_and_figure_has_its_preset_and_every_figure_draws_something(name):
    """One command per numbered table / figure: its preset file exists and loads; a figure's preset
    draws a picture (``ablate.figures``) unless it is a table of numbers over a swept value."""
    paper = load_paper(name, REPO)
    for table in paper.tables.values():
        assert (REPO / "ablations" / f"{table.preset}.yaml").is_file(), (table.key, table.preset)
        cfg = load_config(REPO / "params.yaml", {"ablate.preset": table.preset})
        if table.kind == "figure":
            assert cfg.ablate.figures or cfg.ablate.plot_x, (table.key, "draws nothing")


@pytest.mark.parametrize("pairs", ["demo", "flickr30k", "coco"])
def test_every_retrieval_column_a_paper_maps_is_a_key_the_evaluation_writes(pairs):
    """The column maps name the keys `test_set_metrics` writes for the data's test set (the set
    names of `retrieval_set_name`, R@K keyed RK): a map naming anything else would leave its cells
    empty in every report."""
    import numpy as np

    from mmcse.analysis.papers import known_metric
    from mmcse.data.prepare import retrieval_set_name
    from mmcse.evaluation.names import ndcg_key
    from mmcse.evaluation.ndcg import KINDS, K
    from mmcse.evaluation.retrieval import retrieval_metrics

    rng = np.random.default_rng(0)
    names = {retrieval_set_name(pairs)} | ({"coco_1k"} if pairs == "coco" else set())
    recall = retrieval_metrics(rng.normal(size=(4, 3)), rng.normal(size=(8, 3)), [0, 0, 1, 1, 2, 2, 3, 3])
    ndcg = [ndcg_key(K, kind, d) for kind in KINDS for d in ("i2t", "t2i", None)]
    written = {f"{name}_{k}" for name in names for k in [*recall, *ndcg]}
    assert all(known_metric(k) for k in written)
    mapped = {m for paper in list_papers() for table in load_paper(paper).tables.values()
              for m in table.columns.values() if any(m.startswith(f"{n}_") for n in names)}
    assert mapped <= written and (mapped or pairs == "demo")  # DALR Table 4 (flickr30k), DUET Tables 1-2 (coco)


def test_a_paper_name_is_a_name_not_a_path(tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "evil.yaml").write_text("paper: outside\ntables: {}\n")
    with pytest.raises(ConfigError, match="no paper file"):
        load_paper("../evil", tmp_path)
