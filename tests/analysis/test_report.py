"""`mmcse.analysis.report`: the paper's cells beside mmcse's, Δ, markers, and the two renderings."""

import base64
import math
import re

import pytest

from mmcse.analysis.papers import load_paper
from mmcse.analysis.report import (
    DEMO_WARNING,
    Reproduction,
    RunCell,
    block_grid,
    paper_report,
    to_html,
    to_markdown,
)

PAPER = """\
paper: A paper
text: p.txt
tables:
  table1:
    title: STS
    source: Table 1
    preset: p-table1
    columns: {STS-B: STSBenchmark, Avg.: avg}
    blocks:
      flickr-bert:
        A: {line: 1, label: A-BERT, cells: [80.1±0.5, '77.30']}
        B: {line: 2, label: B-BERT, cells: [79.0*±0.4, '76.00']}
        Q: {line: 3, label: Q-BERT, cells: ['70.0', '70.0'], not_reproduced: quoted from another paper}
        Δ: {line: 4, label: Δ, cells: ['+1.1', '+1.30'], difference: [A, B]}
      coco-bert:
        A: {line: 5, label: A-BERT, cells: ['81.0', '78.0']}
  fig2: {title: a figure, preset: p-fig2}
"""


@pytest.fixture
def paper(tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers/p.yaml").write_text(PAPER)
    return load_paper("p", tmp_path)


def run(profile="p-flickr-bert", **rows) -> Reproduction:
    return Reproduction(profile, "r1", "FINISHED", "B", "independent", rows, devices={"A": "cuda NVIDIA H100"})


def test_each_paper_row_gets_mmcse_beside_it_and_the_difference(paper):
    table = paper.tables["table1"]
    found = run(A={"STSBenchmark": RunCell(80.5, 0.3, 5, 0.01), "avg": RunCell(77.0, 0.2, 5, 0.2)},
                B={"STSBenchmark": RunCell(79.5, 0.6, 5), "avg": RunCell(76.25, 0.4, 5)},
                C={"avg": RunCell(60.0, math.nan, 1)})
    header, grid = block_grid(table, table.blocks["flickr-bert"], found)
    assert header == ["row", "", "STS-B", "Avg."]
    assert grid[0] == ["A", "paper (A-BERT)", "80.1±0.5", "77.30"]
    # A's STS-B is significant against the reference B (p 0.01 < 0.05): marked; its avg (p 0.2) is not
    assert grid[1] == ["", "mmcse", "80.5* ± 0.3 (5)", "77.00 ± 0.20 (5)"]
    # the paper's decimals, and the verdict: this table prints no number of runs, so its printed std is the noise of
    # one paper run (STS-B: the distance 0.35 from [80.05, 80.15] against √(0.5² + 0.3²/5) = 0.52: no difference,
    # and no equivalence within ± 0.5 however many seeds mmcse adds, the paper's own 0.5 alone being that wide); the
    # avg prints no std and the test paper no tolerance for it: mmcse's 5 seeds against the interval (one-sample t:
    # -0.295 / (0.2/√5) = -3.30, p = 0.03)
    assert grid[2] == ["", "Δ", "+0.4 inconclusive (the paper's own noise: no number of seeds decides)", "-0.30 lower"]
    assert grid[4] == ["", "mmcse", "79.5 ± 0.6 (5)", "76.25 ± 0.40 (5)"]  # the reference: never marked
    assert grid[6:8] == [["Q", "paper (Q-BERT)", "70.0", "70.0"],
                         ["", "mmcse", "not reproduced: quoted from another paper", ""]]
    # the difference row: mmcse's A − B, beside the printed Δ
    assert grid[8][0] == "Δ" and grid[9] == ["", "mmcse", "1.0 (5)", "0.75 (5)"]
    assert grid[10] == ["", "Δ", "-0.1", "-0.55"]
    # a preset row the paper does not print comes last, mmcse's cells alone
    assert grid[-1] == ["C", "mmcse", "—", "60.00 (1)"]


def test_rows_not_run_and_blocks_not_run_say_so(paper):
    table = paper.tables["table1"]
    _, grid = block_grid(table, table.blocks["flickr-bert"], run(B={"avg": RunCell(76.0, 0.1, 2)}))
    assert ["", "mmcse", "not run yet", ""] in grid
    sections = paper_report(paper, {"table1": [run(B={"avg": RunCell(76.0, 0.1, 2)})]}, {"p-table1"})
    text = to_markdown(sections)
    coco = text.split("### coco-bert")[1].split("###")[0]
    assert "Not run yet: `mmcse profile p-coco-bert && dvc exp run -S ablate.preset=p-table1`" in coco
    # a table whose preset does not exist says there is no command yet
    assert "No preset yet: `ablations/p-fig2.yaml` does not exist" in text
    assert "The paper prints no numbers for it" in text
    flickr = text.split("### flickr-bert")[1].split("###")[0]
    assert "MLflow run `r1` (FINISHED); * = p < 0.05 (independent t-test) against B" in flickr
    assert "trained on cuda NVIDIA H100" in flickr


def test_demo_runs_are_shown_with_a_plain_warning_and_no_difference(paper):
    demo = run("demo", A={"avg": RunCell(66.2, 0.1, 2)})
    text = to_markdown(paper_report(paper, {"table1": [demo]}, {"p-table1"}))
    assert text.count(DEMO_WARNING) == 2  # once at the top, once at the demo block
    block = text.split("### demo (demo data)")[1]
    assert "| A | paper (A-BERT) | 80.1±0.5 | 77.30 |" in block and "| mmcse | — | 66.20 ± 0.10 (2) |" in block
    assert "|  | Δ |" not in block  # no mmcse − paper row (the paper's own Δ row is printed)


def test_html_is_one_self_contained_page(paper):
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6k"
                           "gAAAABJRU5ErkJggg==")
    found = run(A={"avg": RunCell(77.0, 0.2, 5, 0.01)})
    found.figures = {"figures/ablation.png": png}
    page = to_html(paper_report(paper, {"table1": [found]}, {"p-table1"}), "report <p>")
    assert page.startswith("<!DOCTYPE html>") and "<title>report &lt;p&gt;</title>" in page
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page
    assert "<figcaption>figures/ablation.png</figcaption>" in page
    # nothing fetched from elsewhere: no external source, stylesheet or script
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page
    assert '<tr class="paper"><td>A</td><td>paper (A-BERT)</td><td>80.1±0.5</td><td>77.30</td></tr>' in page
    assert "<code>p-table1</code>" in page


def test_markdown_escapes_pipes_in_cells(paper):
    found = run(**{"A|B": {"avg": RunCell(1.0, 0.0, 1)}})
    assert "| A\\|B | mmcse |" in to_markdown(paper_report(paper, {"table1": [found]}, {"p-table1"}))
