"""A paper's tables beside their reproduction: paper value, mmcse's mean ± std over seeds, Δ, and the
table's own significance test, as Markdown and as one self-contained HTML page.

Pure: `Reproduction` holds what one finished (or running) ablation of a table's preset produced
under one profile (`mmcse.experiments.report` reads it from MLflow); `paper_report` lays the paper's
blocks and those reproductions out as `Section` grids that `to_markdown` and `to_html` render.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmcse.analysis.papers import Cell, Paper, PaperRow, PaperTable
from mmcse.analysis.statistics import (
    EQUIVALENCE_SIGMAS,
    HIGHER,
    INCONCLUSIVE,
    LOWER,
    REPRODUCED,
    VERDICT_TESTS,
    reproduction_verdict,
)

ALPHA = 0.05  # the significance level of KDMCSE Table 1's marker
READING_MARK = "◊"  # a row that follows its authors' code (or neither reading) somewhere: a footnote lists where
DEMO = "demo"
DEMO_WARNING = ("Demo data: these numbers come from the offline demo world (the packaged MiniLM student, "
                "synthetic images and captions, a few training steps). They test the pipeline and are NOT "
                "comparable with the paper's; no Δ is given.")


@dataclass(frozen=True)
class RunCell:
    """mmcse's cell of one row and metric: ``mean ± std`` over ``n`` runs, ``p`` of the table's test."""

    mean: float
    std: float = math.nan
    n: int = 0
    p: float = math.nan
    deterministic: bool = False  # no seed changes it (`mmcse.experiments.jobs.seed_free`): it ran once


@dataclass
class Reproduction:
    """One ablation of a table's preset under one profile (its MLflow parent run)."""

    profile: str
    run_id: str
    status: str  # FINISHED / RUNNING / FAILED / KILLED
    reference: str
    test: str
    rows: dict[str, dict[str, RunCell]]  # variant -> metric -> cell
    row_status: dict[str, str] = field(default_factory=dict)  # variant -> ok / failed / partial …
    devices: dict[str, str] = field(default_factory=dict)  # variant -> the device its jobs trained on
    figures: dict[str, bytes] = field(default_factory=dict)  # artifact name -> PNG (figures/ablation.png …)
    # variant -> the offline stand-in teachers it trained with under a paper profile (teachers.stand_ins: allow)
    stand_ins: dict[str, str] = field(default_factory=dict)
    caveats: dict[str, str] = field(default_factory=dict)  # variant -> why it is not its paper's row (the preset's)
    reading: str = "recipe"  # ablate.reading: recipe, printed or code
    # variant -> the points where it does not follow its paper as printed (`mmcse.config.readings.points_off_printed`)
    readings: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> what it needs to run under this profile
    # variant -> the uncommitted code changes its jobs trained with (their commit is not what made them)
    uncommitted: dict[str, str] = field(default_factory=dict)

    @property
    def block(self) -> str:
        """The paper block a profile's runs reproduce: ``kdmcse-flickr-bert`` -> ``flickr-bert``."""
        return self.profile.split("-", 1)[1] if "-" in self.profile else self.profile


@dataclass
class Section:
    """A heading, lines of text, and optionally one grid (header + rows of cells) and a figure."""

    heading: str
    level: int = 2
    lines: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)  # caption -> PNG


def _fmt(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _digits(row: PaperRow | None, i: int) -> int:
    """As many decimals as the paper prints in that cell (2 where it prints no cell)."""
    printed = row.cells[i].printed if row is not None else None
    if not printed:
        return 2
    mean = printed.split("±")[0].rstrip("*")
    return len(mean.split(".")[1]) if "." in mean else 0


def mmcse_cell(cell: RunCell | None, digits: int, reference: bool) -> str:
    if cell is None or not math.isfinite(cell.mean):
        return "—"
    marker = "*" if not reference and math.isfinite(cell.p) and cell.p < ALPHA else ""
    spread = f" ± {_fmt(cell.std, digits)}" if math.isfinite(cell.std) and cell.n > 1 else ""
    return f"{_fmt(cell.mean, digits)}{marker}{spread} ({cell.n})"


def delta(paper: float | None, ours: RunCell | None, digits: int, verdict: dict | None = None) -> str:
    if paper is None or ours is None or not math.isfinite(ours.mean):
        return ""
    return f"{ours.mean - paper:+.{digits}f}" + (f" {verdict_word(verdict)}" if verdict else "")


def verdict_word(verdict: dict) -> str:
    """A cell's verdict as the report prints it: reproduced, higher, lower, or inconclusive with the seeds that would
    decide it (or why no number of seeds would)."""
    if verdict["verdict"] != INCONCLUSIVE:
        return verdict["verdict"]
    if verdict["seeds"] is not None:
        return f"inconclusive (~{verdict['seeds']} seeds would decide)"
    if verdict["margin"] is None:
        return "inconclusive (no tolerance for the metric)"
    return "inconclusive (the paper's own noise: no number of seeds decides)"


NO_VERDICT_METRICS = ("train_minutes",)  # a device's minutes are compared, not tested for reproduction


def cell_verdict(table: PaperTable, cell: Cell, metric: str, ours: RunCell | None) -> dict | None:
    """Whether mmcse's cell reproduces the paper's printed one (`reproduction_verdict`): the printed number as the
    interval its digits stand for; Welch's test where the table prints a std over a known number of runs, else the
    metric's reproduction tolerance (`PaperTable.tolerances`), else mmcse's own spread; a deterministic row against
    the interval. None where no test can be made (no printed value, one seed and no tolerance, a difference row,
    training minutes)."""
    if cell.mean is None or ours is None or metric in NO_VERDICT_METRICS:
        return None
    prior = table.tolerances.get(metric)
    return reproduction_verdict(cell.mean, cell.std, table.runs, ours.mean, ours.std, ours.n,
                                resolution=cell.resolution, prior_std=prior[0] if prior else None,
                                deterministic=ours.deterministic, table_runs=table.runs)


AVERAGE = "avg"  # a table's average column: the mean of its other cells, no independent evidence


def _verdicts(table: PaperTable, paper_rows: dict[str, PaperRow], found: Reproduction,
              independent: bool = False) -> list[dict]:
    """Every cell's verdict; ``independent``: without the average column where the table has the cells it averages
    (counting it would count them twice)."""
    metrics = list(table.columns.values())
    averaged = independent and AVERAGE in metrics and len(metrics) > 2
    out = []
    for variant, row in paper_rows.items():
        if row.not_reproduced or row.difference or variant not in found.rows:
            continue
        for i, metric in enumerate(metrics):
            if averaged and metric == AVERAGE:
                continue
            v = cell_verdict(table, row.cells[i], metric, found.rows[variant].get(metric))
            if v is not None:
                out.append(v)
    return out


@dataclass(frozen=True)
class VerdictCounts:
    """One block's independent cells (`_verdicts`): how many were reproduced, differ (higher or lower) or are
    inconclusive, of ``cells`` with a verdict."""

    reproduced: int
    differs: int
    inconclusive: int
    cells: int


def verdict_counts(table: PaperTable, paper_rows: dict[str, PaperRow], found: Reproduction) -> VerdictCounts:
    """The block's verdicts counted over its independent cells."""
    words = [v["verdict"] for v in _verdicts(table, paper_rows, found, independent=True)]
    return VerdictCounts(words.count(REPRODUCED), words.count(HIGHER) + words.count(LOWER),
                         words.count(INCONCLUSIVE), len(words))


def verdict_lines(table: PaperTable, paper_rows: dict[str, PaperRow], found: Reproduction) -> list[str]:
    """The block's verdict and the tests behind it, stated under its table, with the tolerances it used."""
    verdicts = _verdicts(table, paper_rows, found, independent=True)
    if not verdicts:
        return ["Verdict: none yet (a cell needs a printed value and at least 2 seeds, or one seed of a deterministic "
                "row, or a tolerance for its metric)."]
    counts = verdict_counts(table, paper_rows, found)
    seeds = [v["seeds"] for v in verdicts if v["verdict"] == INCONCLUSIVE and v["seeds"] is not None]
    more = f"; about {max(seeds)} seeds would decide every inconclusive one that seeds can" if seeds else ""
    used = sorted({v["test"] for v in verdicts}, key=list(VERDICT_TESTS).index)
    tests = "; ".join(f"{name}: {VERDICT_TESTS[name]}" for name in used)
    runs = f"; the paper's cells are over {table.runs} runs" if table.runs and {"welch", "prior"} & set(used) else ""
    tolerance = ""
    if table.tolerances:
        tolerance = (" Tolerances σ (the root mean square of the papers' printed stds of the metric; the equivalence "
                     "margin's unit, and the paper's noise where it prints none): " + ", ".join(
                         f"{metric} {sigma:.2f} ({cells} cells)" for metric, (sigma, cells) in table.tolerances.items())
                     + ".")
    averaged = "; the average column is not counted again" if AVERAGE in table.columns.values() and len(
        table.columns) > 2 else ""
    return [f"**Verdict: of {counts.cells} independent cells, {counts.reproduced} reproduced, {counts.differs} differ, "
            f"{counts.inconclusive} inconclusive{more}** (α = {ALPHA}{averaged}; "
            "beside each Δ: reproduced, higher, lower or inconclusive). A printed number stands for the interval its "
            "digits round from (76.3: 76.25–76.35), and a test measures mmcse's distance to it: a difference test "
            f"(two-sided) and an equivalence test (two one-sided tests within ± {EQUIVALENCE_SIGMAS:g}σ, σ the "
            "metric's tolerance); neither "
            f"deciding is inconclusive. Tests: {tests}{runs}.{tolerance} Assumed: each side's runs are a normal "
            "sample."]


def _difference(rows: dict[str, dict[str, RunCell]], pair: tuple[str, str], metric: str) -> RunCell | None:
    a, b = (rows.get(v, {}).get(metric) for v in pair)
    if a is None or b is None:
        return None
    return RunCell(a.mean - b.mean, math.nan, min(a.n, b.n))


def block_grid(table: PaperTable, paper_rows: dict[str, PaperRow], found: Reproduction | None,
               demo: bool = False) -> tuple[list[str], list[list[str]]]:
    """Rows ``[row, source, cell…]``: for each paper row its printed cells, then mmcse's mean ± std
    (n) with ``*`` where the table's test gives p < 0.05 against its reference, then Δ (mmcse −
    paper; none for demo runs); preset rows the paper lacks follow with mmcse's cells alone."""
    metrics = list(table.columns.values())
    header = ["row", "", *table.columns]
    grid: list[list[str]] = []
    variants = list(paper_rows) + [v for v in (found.rows if found else {}) if v not in paper_rows]
    for variant in variants:
        row = paper_rows.get(variant)
        if row is not None:
            # †: the paper's second text copy marks that cell's significance otherwise (papers/<paper>.yaml)
            grid.append([variant, f"paper ({row.label})",
                         *[(c.printed or "") + ("†" if row.copies_differ(i) else "") for i, c in enumerate(row.cells)]])
        if row is not None and row.not_reproduced:
            grid.append(["", "mmcse", f"not reproduced: {row.not_reproduced}", *[""] * (len(metrics) - 1)])
            continue
        if found is None:
            continue
        if row is not None and row.difference:
            ours = {m: _difference(found.rows, row.difference, m) for m in metrics}
        elif variant in found.rows:
            ours = found.rows[variant]
        elif variant in found.skipped:
            grid.append(["" if row else variant, "mmcse", f"not run: {found.skipped[variant]}",
                         *[""] * (len(metrics) - 1)])
            continue
        else:
            grid.append(["" if row else variant, "mmcse", "not run yet", *[""] * (len(metrics) - 1)])
            continue
        is_reference = variant == found.reference
        status = found.row_status.get(variant, "ok")
        label = "mmcse" + ("" if status == "ok" else f" ({status})")
        if variant in found.stand_ins:
            label += " (not the paper's teacher)"
        if variant in found.caveats:
            label += " (not the paper's row)"
        if variant in found.readings:
            label += f" {READING_MARK}"
        if variant in found.uncommitted:
            label += " (uncommitted code)"
        grid.append(["" if row else variant, label,
                     *[mmcse_cell(ours.get(m), _digits(row, i), is_reference) for i, m in enumerate(metrics)]])
        if row is not None and not demo:
            verdicts = [None if row.difference else cell_verdict(table, row.cells[i], m, ours.get(m))
                        for i, m in enumerate(metrics)]
            grid.append(["", "Δ", *[delta(row.cells[i].mean, ours.get(m), _digits(row, i), verdicts[i])
                                    for i, m in enumerate(metrics)]])
    return header, grid


def _run_command(paper: Paper, table: PaperTable, block: str) -> str:
    profile = f"{paper.name}-{block}"
    return f"mmcse profile {profile} && dvc exp run -S ablate.preset={table.preset}"


def table_sections(paper: Paper, table: PaperTable, found: Sequence[Reproduction],
                   preset_exists: bool) -> list[Section]:
    """The sections of one table: its heading and source, then one per paper block (with the
    reproduction of that block's profile, or how to run it) and one per reproduction whose
    profile matches no block (the demo's: with the demo warning)."""
    head = Section(f"{paper.name.upper()} {table.name}: {table.title}",
                   lines=[f"Source: {table.source}." if table.source else "", f"Preset: `{table.preset}`."])
    if not preset_exists:
        head.lines.append(f"No preset yet: `ablations/{table.preset}.yaml` does not exist, so no command "
                          "reproduces this table yet.")
    if not table.blocks:
        head.lines.append("The paper prints no numbers for it: the reproduction is the figure (or examples) "
                          "its preset's ablation draws.")
    sections = [head]
    for block, rows in table.blocks.items():
        runs = [r for r in found if r.block == block]
        if not runs:
            section = Section(f"{block}", level=3)
            section.lines.append("Not run yet" + (f": `{_run_command(paper, table, block)}`" if preset_exists else "."))
            section.header, section.rows = block_grid(table, rows, None)
            sections.append(section)
        for run in sorted(runs, key=lambda r: READINGS_ORDER.get(r.reading, 9)):
            shown = len(runs) > 1 or run.reading != "recipe"
            section = Section(f"{block}" + (f", reading {run.reading}" if shown else ""), level=3)
            section.lines.append(_run_line(run))
            for variant, why in run.caveats.items():
                section.lines.append(f"Not the paper's row: {variant}: {why}.")
            for variant, teachers in run.stand_ins.items():
                section.lines.append(f"Not the paper's teacher: row {variant} trained with offline stand-ins "
                                     f"(teachers.stand_ins: allow): {teachers}.")
            section.lines += reading_notes(run)
            for variant, changes in run.uncommitted.items():
                section.lines.append(f"Uncommitted code: row {variant} trained with uncommitted changes in {changes}.")
            if table.columns:
                section.lines += verdict_lines(table, rows, run)
            section.header, section.rows = block_grid(table, rows, run)
            sections.append(section)
    first = next(iter(table.blocks.values()), {})
    for run in found:
        if run.block in table.blocks:
            continue
        demo = run.profile == DEMO
        section = Section(f"{run.profile}" + (" (demo data)" if demo else " (no block of the paper's table)"),
                          level=3, lines=[_run_line(run), *reading_notes(run)])
        if demo:
            section.lines.insert(0, f"**{DEMO_WARNING}** Beside them: the paper's first block "
                                    f"({next(iter(table.blocks), 'none')}) for orientation.")
        section.header, section.rows = block_grid(table, first, run, demo=True) if table.columns else ([], [])
        section.figures = run.figures
        sections.append(section)
    for run in found:
        if run.block in table.blocks and run.figures:
            sections.append(Section(f"{run.block}: figures", level=3, figures=run.figures))
    return sections


READINGS_ORDER = {"recipe": 0, "printed": 1, "code": 2}


def reading_notes(run: Reproduction) -> list[str]:
    """The footnote of the rows marked `READING_MARK`: per row, each point where it does not follow its paper
    as printed; or that every row does."""
    if not run.readings:
        return [f"Reading `{run.reading}`: every row follows its paper as printed where paper and code differ."]
    return [f"Reading `{run.reading}`; {READING_MARK} {variant} departs from its paper as printed at: "
            + "; ".join(points) + "." for variant, points in run.readings.items()]


def _run_line(run: Reproduction) -> str:
    devices = sorted(set(run.devices.values()))
    return (f"mmcse: profile `{run.profile}`, MLflow run `{run.run_id}` ({run.status}); * = p < {ALPHA} "
            f"({run.test} t-test) against {run.reference}; cells: mean ± std (runs); —: a metric these runs do "
            "not report"
            + (f"; trained on {', '.join(devices)}" if devices else "") + ".")


def paper_report(paper: Paper, found: dict[str, list[Reproduction]], presets: set[str],
                 tables: Sequence[str] | None = None) -> list[Section]:
    """Every table of ``paper`` (or those in ``tables``, e.g. ``["table3"]``) in the paper's order."""
    keys = [k for k in paper.tables if tables is None or k in tables]
    intro = Section(f"{paper.title}: the paper's numbers beside mmcse's", level=1, lines=[
        "Each block compares the paper's printed cell (paper), mmcse's mean ± std over seeds with the number "
        "of runs (mmcse) and their difference (Δ = mmcse − paper), from the latest ablation of the table's preset "
        "under the block's profile (MLflow experiment `<prefix>-ablate`).",
    ])
    if any(r.profile == DEMO for k in keys for r in found.get(k, [])):
        intro.lines.append(f"**{DEMO_WARNING}**")
    sections = [intro]
    for key in keys:
        table = paper.tables[key]
        sections += table_sections(paper, table, found.get(key, []), table.preset in presets)
    return sections


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(sections: Sequence[Section]) -> str:
    out: list[str] = []
    for s in sections:
        out += [f"{'#' * s.level} {s.heading}", ""]
        out += [line for line in s.lines if line] + ([""] if any(s.lines) else [])
        if s.header:
            out.append("| " + " | ".join(_md_cell(h) for h in s.header) + " |")
            out.append("|" + "---|" * len(s.header))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in s.rows]
            out.append("")
        if s.figures:
            out += [f"(figures in the HTML report: {', '.join(s.figures)})", ""]
    return "\n".join(out).rstrip() + "\n"


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #bbb;padding:2px 6px;text-align:right;font-size:90%}"
         "td:first-child,td:nth-child(2){text-align:left}tr.paper td{background:#f4f4f4}"
         "tr.delta td{color:#555}img{max-width:100%}")


def to_html(sections: Sequence[Section], title: str) -> str:
    """One page, no external resource: styles inline, figures as data URIs (opens offline)."""
    def inline(text: str) -> str:  # **bold** and `code` of the Markdown lines
        parts = html.escape(text).split("**")
        text = "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))
        parts = text.split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))

    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
           f"<style>{STYLE}</style></head><body>"]
    for s in sections:
        level = min(s.level, 6)
        out.append(f"<h{level}>{html.escape(s.heading)}</h{level}>")
        out += [f"<p>{inline(line)}</p>" for line in s.lines if line]
        if s.header:
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in s.header)
                       + "</tr></thead><tbody>")
            for row in s.rows:
                kind = "paper" if row[1].startswith("paper") else "delta" if row[1] == "Δ" else "mmcse"
                out.append(f'<tr class="{kind}">' + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
            out.append("</tbody></table>")
        for caption, png in s.figures.items():
            data = base64.b64encode(png).decode("ascii")
            out.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
