"""Comparison tables: per-task paired t-tests against the reference row, markers, transfer column."""

import csv
import json
import math

import numpy as np
import pytest

from mmcse.analysis.statistics import independent_significance, paired_significance
from mmcse.analysis.tables import aggregate, table_markdown, write_table
from mmcse.config import ConfigError, parse_config
from mmcse.experiments.params import load_config
from mmcse.io import tracked
from tests.conftest import REPO

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]


def _t_cdf(t: float, df: int) -> float:
    """Student t CDF in closed form for 1 and 2 degrees of freedom (Cauchy; df=2 algebraic)."""
    if df == 1:
        return 0.5 + math.atan(t) / math.pi
    if df == 2:
        return 0.5 + t / (2 * math.sqrt(2 + t * t))
    raise ValueError(df)


def _paired_t(a: list[float], b: list[float]) -> tuple[float, float]:
    """t = mean(d) / (sd(d) / sqrt(n)), d = a - b, sd with n - 1; two-sided p = 2 (1 - F(|t|))."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = mean / (sd / math.sqrt(n))
    return t, 2 * (1 - _t_cdf(abs(t), n - 1))


def _ok(variant, seed, scores):
    return {"variant": variant, "seed": seed, "status": "ok", "scores": scores}


def _results():
    """Reference ``ref`` on seeds 1–3; ``up`` better on every seed; ``mixed``; ``one`` single seed;
    ``gap``: seed 3 failed, so 2 pairs (1 degree of freedom)."""
    ref = {1: (70.0, 60.0), 2: (71.0, 62.0), 3: (73.0, 61.0)}
    up = {1: (72.0, 61.0), 2: (72.5, 61.0), 3: (74.0, 60.5)}  # STS12 d = 2, 1.5, 1: t = 3√3
    mixed = {1: (71.0, 60.0), 2: (70.0, 63.0), 3: (73.5, 61.0)}
    out = []
    for name, by_seed in (("ref", ref), ("up", up), ("mixed", mixed)):
        out += [_ok(name, s, {"STS12": a, "STS13": b, "avg": (a + b) / 2}) for s, (a, b) in by_seed.items()]
    out.append(_ok("one", 2, {"STS12": 90.0, "STS13": 90.0, "avg": 90.0}))
    out += [_ok("gap", 1, {"STS12": 75.0, "STS13": 61.0, "avg": 68.0}),
            _ok("gap", 2, {"STS12": 73.0, "STS13": 62.5, "avg": 67.75}),
            {"variant": "gap", "seed": 3, "status": "failed", "error": "oom"}]
    return out


def _cfg(transfer=False):
    names = ["ref", "up", "mixed", "one", "gap"]
    return parse_config({"ablate": {"variants": {n: {} for n in names}, "reference": "ref", "seeds": [1, 2, 3],
                                    "transfer": transfer}})


def test_paired_significance_matches_a_direct_transcription():
    tests = paired_significance(_results(), "ref", ["STS12", "STS13", "avg"])
    assert set(tests) == {"up", "mixed", "one", "gap"}  # every variant but the reference
    ref = {s: r["scores"] for r in _results() if r["variant"] == "ref" for s in [r["seed"]]}
    for variant, seeds in (("up", [1, 2, 3]), ("mixed", [1, 2, 3]), ("gap", [1, 2])):
        runs = {r["seed"]: r["scores"] for r in _results() if r["variant"] == variant and r["status"] == "ok"}
        for m in ("STS12", "STS13", "avg"):
            t, p = _paired_t([runs[s][m] for s in seeds], [ref[s][m] for s in seeds])
            cell = tests[variant][m]
            assert cell["n"] == len(seeds) and cell["note"] == ""
            assert cell["t"] == pytest.approx(t, rel=1e-9) and cell["p"] == pytest.approx(p, rel=1e-9, abs=1e-12)
            assert cell["mean_diff"] == pytest.approx(np.mean([runs[s][m] - ref[s][m] for s in seeds]))
    # by hand: d = (2, 1.5, 1), mean 1.5, sd 0.5, t = 1.5 / (0.5/√3) = 3√3, p = 1 - t/√(2 + t²) = 1 - √(27/29)
    assert tests["up"]["STS12"]["t"] == pytest.approx(3 * math.sqrt(3))
    assert tests["up"]["STS12"]["p"] == pytest.approx(1 - math.sqrt(27 / 29))
    one = tests["one"]["STS12"]
    assert math.isnan(one["t"]) and math.isnan(one["p"])
    assert (one["n"], one["mean_diff"], one["note"]) == (1, 19.0, "n<2")


def _independent_t(a: list[float], b: list[float]) -> float:
    """Student's two-sample t: (mean a − mean b) / (s_p √(1/n_a + 1/n_b)), s_p² pooled with n − 1."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    sp = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    return (ma - mb) / (sp * math.sqrt(1 / na + 1 / nb))


def test_independent_significance_matches_a_direct_transcription():
    """KDMCSE Table 1's test: every finished run of each row, no pairing by seed."""
    tests = independent_significance(_results(), "ref", ["STS12", "STS13", "avg"])
    ref = [r["scores"] for r in _results() if r["variant"] == "ref"]
    for variant in ("up", "mixed", "gap"):
        runs = [r["scores"] for r in _results() if r["variant"] == variant and r["status"] == "ok"]
        for m in ("STS12", "STS13", "avg"):
            cell = tests[variant][m]
            assert (cell["n"], cell["n_reference"], cell["note"]) == (len(runs), 3, "")
            assert cell["t"] == pytest.approx(_independent_t([x[m] for x in runs], [x[m] for x in ref]), rel=1e-9)
            assert cell["mean_diff"] == pytest.approx(np.mean([x[m] for x in runs]) - np.mean([x[m] for x in ref]))
    # pairing matters: 'up' beats the reference on each seed (paired p 0.035) but not by much across seeds
    assert tests["up"]["STS12"]["p"] > 0.05 > paired_significance(_results(), "ref", ["STS12"])["up"]["STS12"]["p"]
    # by hand, two runs each (2 degrees of freedom): a = (72, 74), b = (70, 71): s_p² = (2 + 0.5) / 2,
    # t = 2.5 / √1.25 = √5, p = 1 − t/√(2 + t²) = 1 − √(5/7)
    two = [_ok("a", 1, {"avg": 72.0}), _ok("a", 2, {"avg": 74.0}), _ok("b", 1, {"avg": 70.0}),
           _ok("b", 2, {"avg": 71.0})]
    cell = independent_significance(two, "b", ["avg"])["a"]["avg"]
    assert cell["t"] == pytest.approx(math.sqrt(5)) and cell["p"] == pytest.approx(1 - math.sqrt(5 / 7))
    assert cell["p"] == pytest.approx(2 * (1 - _t_cdf(math.sqrt(5), 2)))
    one = tests["one"]["STS12"]
    assert math.isnan(one["p"]) and (one["n"], one["note"]) == (1, "n<2")


def test_an_independent_table_names_its_test_and_counts_runs():
    cfg = parse_config({"ablate": {"variants": {n: {} for n in ["ref", "up", "mixed", "one", "gap"]},
                                   "reference": "ref", "seeds": [1, 2, 3], "test": "independent"}})
    rows = {r["variant"]: r for r in aggregate(cfg, _results())}
    up = independent_significance(_results(), "ref", ["avg"])["up"]["avg"]
    assert rows["up"]["p_value"] == pytest.approx(up["p"]) and rows["up"]["test"] == "independent"
    assert rows["gap"]["tested_seeds"] == 2 and "paired_seeds" not in rows["gap"]
    assert rows["one"]["note"] == "n<2: 1 run(s) against 3 of ref, no test"
    md = table_markdown(list(rows.values()), "avg", "ref")
    assert "*: independent two-sample t-test (Student's) against ref over every finished run of each row" in md
    with pytest.raises(ConfigError, match="ablate.test.*must be one of \\['paired', 'independent'\\]"):
        parse_config({"ablate": {"test": "welch"}})


def test_identical_runs_and_a_missing_reference_give_no_test_and_no_crash():
    same = [_ok(v, s, {"avg": 70.0 + s}) for v in ("a", "b") for s in (1, 2)]
    assert paired_significance(same, "a", ["avg"])["b"]["avg"]["note"] == "identical"
    nothing = paired_significance([_ok("b", 1, {"avg": 1.0}), _ok("b", 2, {"avg": 2.0})], "a", ["avg"])
    assert nothing["b"]["avg"]["n"] == 0 and nothing["b"]["avg"]["note"] == "n<2"


def test_table_marks_significant_cells_and_notes_rows_with_too_few_seeds(tmp_path):
    rows = {r["variant"]: r for r in aggregate(_cfg(), _results())}
    assert rows["up"]["STS12_p"] == pytest.approx(1 - math.sqrt(27 / 29))  # 0.035: significant
    assert rows["one"]["note"] == "n<2: 1 seed(s) paired with ref, no test" and rows["one"]["paired_seeds"] == 1
    assert rows["gap"]["paired_seeds"] == 2 and rows["gap"]["status"] == "partial (1 failed)"
    md = table_markdown(list(rows.values()), "avg", "ref", "T")
    lines = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert lines["variant"] == "| variant | STS12 | STS13 | STS avg | p vs ref (STS avg) | seeds | status |"
    up = lines["up"].split(" | ")
    assert up[1] == f"{np.mean([72.0, 72.5, 74.0]):.2f}* ± {np.std([72.0, 72.5, 74.0], ddof=1):.2f}"
    assert "*" not in up[2]  # STS13: p > 0.05
    assert up[4] == f"{rows['up']['avg_p']:.3f}"
    assert "*" not in lines["one"] and lines["one"].endswith("| n<2 | 1 | ok |")
    assert lines["ref"].endswith("| reference | 3 | ok |") and "*" not in lines["ref"]
    assert "*: paired t-test against ref" in md and "p < 0.05" in md

    files = write_table(list(rows.values()), tmp_path, "avg", "ref", "T")
    with open(files["csv"]) as handle:
        table = {r["variant"]: r for r in csv.DictReader(handle)}
    assert float(table["up"]["STS12_p"]) == pytest.approx(rows["up"]["STS12_p"])
    assert table["one"]["avg_p"] == "" and table["one"]["note"].startswith("n<2")
    assert {f"{m}_p" for m in ("STS12", "STS13", "avg")} <= set(table["up"])


def test_columns_follow_senteval_order_with_averages_after_their_tasks():
    scores = {t: 70.0 for t in reversed(TASKS)} | {"avg": 70.0, "transfer_avg": 80.0, "TREC": 80.0, "MR": 80.0}
    results = [_ok(v, s, scores) for v in ("ref", "up") for s in (1, 2)]
    cfg = parse_config({"ablate": {"variants": {"ref": {}, "up": {}}, "reference": "ref", "transfer": True}})
    md = table_markdown(aggregate(cfg, results), "avg", "ref")
    assert md.splitlines()[0] == ("| variant | " + " | ".join(TASKS) + " | STS avg | MR | TREC | TR avg | "
                                  "p vs ref (STS avg) | seeds | status |")


def test_transfer_column_says_when_the_data_has_no_transfer_tasks():
    rows = aggregate(_cfg(transfer=True), _results())  # demo data: data.transfer_tasks is empty
    assert all(math.isnan(r["transfer_avg_mean"]) for r in rows)
    assert "data.transfer_tasks is empty" in rows[0]["transfer_note"]
    md = table_markdown(rows, "avg", "ref")
    assert md.splitlines()[0].split(" | ")[4] == "TR avg"
    assert all(line.split(" | ")[4] == "n/a (no transfer tasks)" for line in md.splitlines()[2:7])
    assert "TR avg: no transfer tasks: data.transfer_tasks is empty" in md
    plain = table_markdown(aggregate(_cfg(), _results()), "avg", "ref")  # transfer not asked for: no column
    assert "TR avg" not in plain


def test_dalr_table3_shows_sts_avg_and_tr_avg_and_marks_both():
    cfg = load_config(REPO / "params.yaml", {"ablate.preset": "dalr-table3", "ablate.seeds": [1, 2, 3]})
    assert cfg.ablate.transfer
    names = list(cfg.ablate.variants)
    results = []
    for i, name in enumerate(names):
        for s in (1, 2, 3):
            sts, tr = 78.0 - i + 0.3 * s * (i % 2), 86.0 - 0.5 * i + 0.2 * s
            results.append(_ok(name, s, {"STS12": sts, "avg": sts, "MR": tr, "transfer_avg": tr}))
    rows = {r["variant"]: r for r in aggregate(cfg, results)}
    md = table_markdown(list(rows.values()), cfg.ablate.metric, cfg.ablate.reference)
    header = md.splitlines()[0].split(" | ")
    assert header[2:5] == ["STS avg", "MR", "TR avg"]
    assert "transfer_note" not in rows["DALR"]
    worse = rows["w/o L_CML"]  # d(avg) = -2, d(TR) = -1 on every seed: |t| huge, p ~ 0
    assert worse["transfer_avg_p"] < 1e-6 and worse["avg_p"] < 1e-6
    cells = next(line for line in md.splitlines() if line.startswith("| w/o L_CML ")).split(" | ")
    assert cells[2].split(" ")[0].endswith("*") and cells[4].split(" ")[0].endswith("*")


def test_preset_seeds_and_transfer_keys(tmp_path):
    (tmp_path / "ablations").mkdir()
    (tmp_path / "params.yaml").write_text("ablate:\n  preset: p\n  seeds: [7]\n")
    (tmp_path / "ablations/p.yaml").write_text("seeds: [1, 2, 3]\ntransfer: true\nvariants:\n  a: {}\n")
    cfg = load_config(tmp_path / "params.yaml")
    assert cfg.ablate.seeds == [1, 2, 3] and cfg.ablate.transfer
    (tmp_path / "ablations/p.yaml").write_text("transfer: yes please\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: key 'transfer': must be true or false, got 'yes please'"):
        load_config(tmp_path / "params.yaml")
    # a preset's keys are AblateConfig's, typed as it declares them (issue 54: no list shadowing it)
    (tmp_path / "ablations/p.yaml").write_text("seeds: [1, two]\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: key 'seeds\[1\]': must be an integer, got 'two'"):
        load_config(tmp_path / "params.yaml")
    (tmp_path / "ablations/p.yaml").write_text("test: welch\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: key 'test': must be one of \['paired', 'independent'\]"):
        load_config(tmp_path / "params.yaml")
    (tmp_path / "ablations/p.yaml").write_text("seed: [1]\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: unknown key\(s\) seed; valid keys: description, base, rows_of, "
                                          r"variants, reference, plot_x, seeds, transfer"):
        load_config(tmp_path / "params.yaml")


def test_log_ablation_puts_p_values_into_mlflow(tmp_path, monkeypatch):
    import mlflow

    from mmcse import tracking
    from mmcse.experiments.ablation_record import log_ablation
    from mmcse.pipeline.paths import Paths

    monkeypatch.chdir(tmp_path)
    cfg = _cfg()
    results = _results()
    rows = aggregate(cfg, results)
    paths = Paths.of(cfg)
    files = write_table(rows, paths.ablations, "avg", "ref")
    with tracking.run(cfg, "ablate", run_name="t") as parent:
        log_ablation(cfg, rows, files, paths, results)
    run = mlflow.get_run(parent.info.run_id)
    assert run.data.metrics["up/STS12_p"] == pytest.approx(1 - math.sqrt(27 / 29))
    assert "one/avg_p" not in run.data.metrics and "ref/avg_p" not in run.data.metrics  # NaN: left out
    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/ablation_table.json")
    assert {"STS12_p", "avg_p", "note", "paired_seeds"} <= set(table["columns"])
    detail = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/significance.json")
    assert detail["reference"] == "ref" and detail["alpha"] == 0.05
    assert detail["variants"]["one"]["avg"] == {"t": None, "p": None, "n": 1, "mean_diff": 23.5, "note": "n<2"}
    summary = json.loads((tmp_path / "metrics/ablate.json").read_text())["variants"]
    # metrics/ablate.json at DVC's precision (MLflow keeps every digit)
    assert summary["up"]["p"] == tracked(rows[1]["avg_p"]) and summary["one"]["note"].startswith("n<2")


def test_a_wide_table_prints_as_aligned_blocks_within_120_columns():
    from mmcse.analysis.text import terminal_table

    header = ["variant", *[f"column_number_{i}_with_a_long_name" for i in range(9)], "status"]
    rows = [["mcse", *[f"{i}.00 ± 0.1{i}" for i in range(9)], "ok"], ["a longer row name", *["—"] * 9, "failed"]]
    md = "\n".join(["# the title", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                    *("| " + " | ".join(r) + " |" for r in rows), "", "*: " + "a note that runs on " * 10])
    text = terminal_table(md)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and lines[0] == "# the title"
    blocks = [b.splitlines() for b in text.split("\n\n")[1:-1]]
    assert len(blocks) > 1 and all(b[0].startswith("variant") and b[3].startswith("a longer row name") for b in blocks)
    shown = [name for b in blocks for name in b[0].split()[1:]]
    assert shown == header[1:]  # every column once, in order
    for b in blocks:  # aligned: each column's cells start where its header does
        starts = [b[0].index(name) for name in b[0].split()]
        for line in (b[2], b[3]):
            assert all(line[s - 1] == " " for s in starts[1:])
    assert "0.00 ± 0.10" in text and text.rstrip().endswith("a note that runs on")
    assert terminal_table("no table here") == "no table here"


def test_headline_metrics_put_the_primary_first_and_leave_out_the_per_direction_scores():
    from mmcse.analysis.tables import headline_metrics

    row = {f"{m}_mean": 1.0 for m in ("STS12", "avg", "dev_alignment", "demo_i2t_R1", "demo_rsum",
                                      "demo_i2t_NDCG25_rouge_l", "demo_NDCG25_rouge_l", "transfer_avg")}
    assert headline_metrics([row], "avg") == ["avg", "transfer_avg", "demo_NDCG25_rouge_l", "demo_rsum"]
    assert headline_metrics([row], "demo_rsum", limit=2) == ["demo_rsum", "avg"]
    assert headline_metrics([], "avg") == ["avg"]


def test_the_run_description_cuts_whole_lines_and_names_the_artifact():
    from mmcse.tracking import run_description

    table = "".join(f"| row{i} | {i} |\n" for i in range(100))
    assert run_description(table, "the whole table is the run's artifact ablation.md", limit=10_000) == table
    cut = run_description(table, "the whole table is the run's artifact ablation.md", limit=300)
    assert len(cut) <= 300 and cut.startswith("| row0 | 0 |\n") and cut.endswith("ablation.md)\n")
    assert all(line.startswith("| row") and line.endswith("|") for line in cut.split("\n\n")[0].splitlines())
