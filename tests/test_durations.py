"""tests/durations.py: the record a run writes and what `python -m tests.durations` reads from it."""

from __future__ import annotations

import json

import pytest

from tests import durations

RECORD = {
    "wall_seconds": 100.0, "workers": 2, "cpu_count": 2,
    "tests": {
        "tests/a/test_x.py::test_one": {"tier": "fast", "outcome": "passed", "setup": 0.5, "call": 1.0,
                                        "teardown": 0.25, "start": 1.0, "stop": 2.75},
        "tests/a/test_x.py::test_two[p]": {"tier": "slow", "outcome": "passed", "call": 40.0, "start": 0.0,
                                           "stop": 40.0},
        "tests/b/test_y.py::test_three": {"tier": "slow", "outcome": "failed", "setup": 10.0, "call": 5.0,
                                          "start": 3.0, "stop": 18.0},
    },
}


def test_a_tests_time_is_its_setup_call_and_teardown_summed_per_file_and_tier():
    assert durations.test_seconds(RECORD["tests"]["tests/a/test_x.py::test_one"]) == pytest.approx(1.75)
    assert durations.by_file(RECORD["tests"]) == {"tests/a/test_x.py": (pytest.approx(41.75), 2),
                                                  "tests/b/test_y.py": (15.0, 1)}
    assert durations.by_tier(RECORD["tests"]) == {"fast": (pytest.approx(1.75), 1), "slow": (55.0, 2)}
    assert durations.tier_span(RECORD["tests"], "slow") == (0.0, 40.0)


def test_the_summary_ranks_tests_and_files_by_their_time():
    lines = durations.summary(RECORD, top=2, files=1)
    assert lines[0] == "suite: 3 tests, 0.9 min in tests, 1.7 min wall (2 workers)"
    assert lines[1].split() == ["slow", "tier", "(-m", "slow):", "2", "tests", "0.9", "min", "in", "tests,", "ran",
                                "from", "0.0", "to", "0.7", "min"]
    ranked = [line.split()[-1] for line in lines[lines.index("slowest 2 tests (setup + call + teardown):") + 1:][:2]]
    assert ranked == ["tests/a/test_x.py::test_two[p]", "tests/b/test_y.py::test_three"]
    assert lines[-2:] == ["costliest 1 files:", "     41.8 s     2 tests  tests/a/test_x.py"]
    fast = durations.summary(RECORD, top=5, tier="fast")
    assert [line for line in fast if "::" in line] == ["      1.8 s  fast  tests/a/test_x.py::test_one"]


def test_two_runs_compare_file_by_file_largest_saving_first():
    old = json.loads(json.dumps(RECORD))
    old["tests"]["tests/b/test_y.py::test_three"]["call"] = 65.0
    lines = durations.comparison(RECORD, old)
    assert lines[1].split() == ["75.0s", "15.0s", "-60.0s", "tests/b/test_y.py"]
    assert lines[-1].split()[2:] == ["-60.0s", "all", "files"]


def test_the_command_reads_a_run_and_names_a_missing_or_foreign_file(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RECORD))
    assert durations.main([str(path), "--top", "1", "--files", "0"]) == 0
    assert "tests/a/test_x.py::test_two[p]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        durations.main([str(tmp_path / "none.json")])
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a durations record"):
        durations.main([str(path)])


def test_the_plugin_records_each_phase_tier_and_outcome_of_a_run(pytester):
    pytester.makeconftest('pytest_plugins = ["tests.durations"]')
    pytester.makepyfile(test_sample="""
        import time, pytest

        @pytest.fixture
        def slow_setup():
            time.sleep(0.2)

        def test_fast(slow_setup):
            pass

        @pytest.mark.slow
        def test_slow():
            time.sleep(0.1)

        def test_fails():
            assert False

        def test_burns_cpu_in_a_child():  # CPU of a process the test waited for counts
            import subprocess, sys
            subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                            "while time.process_time() - t < 0.5: pass"], check=True)

        def test_sleeps():
            time.sleep(0.5)
    """)
    pytester.syspathinsert(str(durations.REPO))
    out = pytester.path / "record.json"
    pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", f"--durations-file={out}", "--slowest=2",
                       "-o", "addopts=", "-o", "markers=slow: slow")
    record = json.loads(out.read_text())["tests"]
    assert record["test_sample.py::test_fast"]["setup"] >= 0.2 and record["test_sample.py::test_fast"]["tier"] == "fast"
    assert record["test_sample.py::test_slow"]["call"] >= 0.1 and record["test_sample.py::test_slow"]["tier"] == "slow"
    assert record["test_sample.py::test_fails"]["outcome"] == "failed"
    assert record["test_sample.py::test_burns_cpu_in_a_child"]["cpu"] >= 0.5
    assert record["test_sample.py::test_sleeps"]["cpu"] < 0.3 <= record["test_sample.py::test_sleeps"]["call"]


def test_a_record_with_cpu_seconds_ranks_by_them_on_request():
    record = json.loads(json.dumps(RECORD))
    cpu = {"tests/a/test_x.py::test_one": 30.0, "tests/a/test_x.py::test_two[p]": 1.0,
           "tests/b/test_y.py::test_three": 14.0}
    for nodeid, seconds in cpu.items():
        record["tests"][nodeid]["cpu"] = seconds
    lines = durations.summary(record, top=1, files=2, by="cpu")
    assert lines[0] == "suite: 3 tests, 0.9 min in tests, 0.8 min of CPU, 1.7 min wall (2 workers)"
    assert lines[-4].split()[-1] == "tests/a/test_x.py::test_one"
    assert lines[-2:] == ["     41.8 s     31.0 s CPU     2 tests  tests/a/test_x.py",
                          "     15.0 s     14.0 s CPU     1 tests  tests/b/test_y.py"]
    by_wall = durations.summary(record, top=1, files=1)
    assert by_wall[-3].split()[-1] == "tests/a/test_x.py::test_two[p]"


class _Item:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.keywords = nodeid, {"slow": 1} if slow else {}


def test_workers_get_the_costliest_files_first_by_the_tiers_that_run():
    """pytest-xdist hands out files in the items' order: the costliest first, each file's tests together and in
    their order, a file the record does not know first of all (a new file cannot then run alone at the end)."""
    seconds = durations.file_seconds(RECORD)
    assert seconds == {"tests/a/test_x.py": {"fast": 1.8, "slow": 40.0}, "tests/b/test_y.py": {"slow": 15.0}}
    items = [_Item("tests/b/test_y.py::test_three", slow=True), _Item("tests/a/test_x.py::test_one"),
             _Item("tests/c/test_new.py::test_four"), _Item("tests/a/test_x.py::test_two[p]", slow=True)]
    ordered = [i.nodeid for i in durations.costliest_files_first(items, seconds)]
    assert ordered == ["tests/c/test_new.py::test_four", "tests/a/test_x.py::test_one",
                       "tests/a/test_x.py::test_two[p]", "tests/b/test_y.py::test_three"]
    # the fast tier alone: a file is ranked by its fast tests' seconds (y: 3.0, x: 1.8), not by its slow ones
    fast_only = [items[1], _Item("tests/b/test_y.py::test_five")]
    seconds["tests/b/test_y.py"]["fast"] = 3.0
    assert [i.nodeid for i in durations.costliest_files_first(fast_only, seconds)] == [
        "tests/b/test_y.py::test_five", "tests/a/test_x.py::test_one"]


def test_the_order_is_saved_from_a_whole_suite_run_only(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RECORD))
    monkeypatch.setattr(durations, "ORDER_FILE", tmp_path / "file_seconds.json")
    assert durations.main([str(path), "--save-order"]) == 0
    assert json.loads((tmp_path / "file_seconds.json").read_text()) == durations.file_seconds(RECORD)
    slow_only = {"tests": {k: v for k, v in RECORD["tests"].items() if v["tier"] == "slow"}}
    path.write_text(json.dumps(slow_only))
    with pytest.raises(SystemExit, match="not a run of both tiers"):
        durations.main([str(path), "--save-order"])


def test_the_committed_order_is_a_seconds_record_of_this_suite():
    seconds = json.loads(durations.ORDER_FILE.read_text())
    assert all(set(tiers) <= {"fast", "slow"} and all(s >= 0 for s in tiers.values()) for tiers in seconds.values())
    assert "tests/pipeline/test_pipeline_smoke.py" in seconds  # the costliest file, first by name
