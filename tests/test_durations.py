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
    """)
    pytester.syspathinsert(str(durations.REPO))
    out = pytester.path / "record.json"
    pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", f"--durations-file={out}", "--slowest=2",
                       "-o", "addopts=", "-o", "markers=slow: slow")
    record = json.loads(out.read_text())["tests"]
    assert record["test_sample.py::test_fast"]["setup"] >= 0.2 and record["test_sample.py::test_fast"]["tier"] == "fast"
    assert record["test_sample.py::test_slow"]["call"] >= 0.1 and record["test_sample.py::test_slow"]["tier"] == "slow"
    assert record["test_sample.py::test_fails"]["outcome"] == "failed"
