"""Where the suite's time goes: a pytest plugin that records every test's time, and a command that reads it.

The plugin (loaded by tests/conftest.py) writes ``.pytest-durations.json`` at the repository root after every run
(``--durations-file PATH`` elsewhere, ``--durations-file ''`` not at all): per test its setup, call and teardown
seconds, the CPU seconds it used (its worker's and those of the processes it started and waited for: where the
suite keeps every core busy, CPU, not wall time, is what a cut must save), its outcome and its tier (``slow`` when
marked so, else ``fast``), and the session's wall time. At the end of a run of 50 tests or more it prints the
tiers' totals, the slowest tests and the costliest files (``--slowest N`` sets how many, 0 prints nothing). A
session fixture's setup is counted in the first test that asks for it, as pytest itself counts it.

The command reads such a file again, so a closing note can say where the time went::

    python -m tests.durations                          # .pytest-durations.json: tiers, 30 tests, 15 files
    python -m tests.durations run.json --top 50 --files 40 --tier slow
    python -m tests.durations run.json --by cpu        # the tests and files that used the most CPU
    python -m tests.durations new.json --against old.json   # per file: before, after, difference
    python -m tests.durations --save-order               # tests/file_seconds.json from a whole-suite run

The plugin also orders the files it hands to pytest-xdist's workers: the costliest first (by the committed
``tests/file_seconds.json``, each file's seconds per tier), so the short files fill both workers at the end instead
of one long file running alone (the fast tier: one worker idle for the last 20 s, before). A file not in it
(a new one) goes first, where its time cannot leave a worker waiting; a stale entry only changes an order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILE = REPO / ".pytest-durations.json"
ORDER_FILE = REPO / "tests" / "file_seconds.json"
PHASES = ("setup", "call", "teardown")
SUMMARY_FROM = 50  # a run of fewer tests (one file, one test) prints no summary unless --slowest is given


# --- reading a record -------------------------------------------------------------------------------------------


def test_seconds(test: dict) -> float:
    return sum(test.get(phase, 0.0) for phase in PHASES)


def cpu_seconds(test: dict) -> float:
    """The CPU seconds a test used, its phases summed (0 in a record written before they were kept)."""
    return test.get("cpu", 0.0)


MEASURES = {"wall": test_seconds, "cpu": cpu_seconds}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def by_file(tests: dict[str, dict], measure=test_seconds) -> dict[str, tuple[float, int]]:
    """Each test file's seconds (by default setup + call + teardown of its tests) and number of tests."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for nodeid, test in tests.items():
        totals[file_of(nodeid)][0] += measure(test)
        totals[file_of(nodeid)][1] += 1
    return {name: (seconds, count) for name, (seconds, count) in totals.items()}


def by_tier(tests: dict[str, dict]) -> dict[str, tuple[float, int]]:
    totals: dict[str, list] = {"fast": [0.0, 0], "slow": [0.0, 0]}
    for test in tests.values():
        totals[test["tier"]][0] += test_seconds(test)
        totals[test["tier"]][1] += 1
    return {tier: (seconds, count) for tier, (seconds, count) in totals.items()}


def tier_span(tests: dict[str, dict], tier: str) -> tuple[float, float] | None:
    """When ``tier``'s first test started and its last one ended, in seconds from the session's start (the
    phase of the run it took; the tiers overlap where workers run tests of both at once)."""
    times = [(t["start"], t["stop"]) for t in tests.values() if t["tier"] == tier and "start" in t]
    return (min(a for a, _ in times), max(b for _, b in times)) if times else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:5.1f} min"


def summary(record: dict, top: int = 30, files: int = 15, tier: str | None = None, by: str = "wall") -> list[str]:
    """The lines printed at the end of a run and by the command; ``by`` ranks tests and files by their wall seconds
    or their CPU seconds."""
    measure = MEASURES[by]
    tests = {k: v for k, v in record["tests"].items() if tier is None or v["tier"] == tier}
    lines = []
    wall = record.get("wall_seconds")
    tiers = by_tier(record["tests"])
    total = sum(seconds for seconds, _ in tiers.values())
    head = f"suite: {len(record['tests'])} tests, {_minutes(total).strip()} in tests"
    cpu = sum(cpu_seconds(test) for test in record["tests"].values())
    if cpu:
        head += f", {_minutes(cpu).strip()} of CPU"
    if wall is not None:
        head += f", {_minutes(wall).strip()} wall"
    workers = record.get("workers", 1)
    if workers > 1:
        head += f" ({workers} workers)"
    lines.append(head)
    for name, selector in (("slow", "-m slow"), ("fast", '-m "not slow"')):
        seconds, count = tiers[name]
        if not count:
            continue
        line = f"  {f'{name} tier ({selector}):':<28}{count:5d} tests {_minutes(seconds)} in tests"
        span = tier_span(record["tests"], name)
        if span is not None:
            line += f", ran from {span[0] / 60:.1f} to {span[1] / 60:.1f} min"
        lines.append(line)
    ranked = sorted(tests.items(), key=lambda item: -measure(item[1]))[:top]
    cpu_column = any("cpu" in test for test in tests.values())
    if ranked:
        in_tier = f" ({tier} tier)" if tier else ""
        lines.append(f"slowest {len(ranked)} tests{in_tier} (setup + call + teardown):" if by == "wall"
                     else f"the {len(ranked)} tests{in_tier} that used the most CPU:")
        for nodeid, test in ranked:
            cpu_text = f"{cpu_seconds(test):7.1f} s CPU  " if cpu_column else ""
            lines.append(f"  {test_seconds(test):7.1f} s  {cpu_text}{test['tier']:4}  {nodeid}")
    walls, cpus = by_file(tests), by_file(tests, cpu_seconds)
    costly = sorted(walls, key=lambda name: -(walls if by == "wall" else cpus)[name][0])[:files]
    if costly:
        lines.append(f"costliest {len(costly)} files{' (CPU)' if by == 'cpu' else ''}:")
        for name in costly:
            seconds, count = walls[name]
            cpu_text = f"{cpus[name][0]:7.1f} s CPU  " if cpu_column else ""
            lines.append(f"  {seconds:7.1f} s  {cpu_text}{count:4d} tests  {name}")
    return lines


def comparison(new: dict, old: dict, files: int = 30) -> list[str]:
    """Per file: seconds before, after and the difference, the largest changes first."""
    before, after = by_file(old["tests"]), by_file(new["tests"])
    rows = []
    for name in set(before) | set(after):
        was, now = before.get(name, (0.0, 0))[0], after.get(name, (0.0, 0))[0]
        rows.append((now - was, name, was, now))
    rows.sort(key=lambda row: row[0])
    lines = [f"{'before':>9} {'after':>9} {'change':>9}  file"]
    for change, name, was, now in rows[:files]:
        lines.append(f"{was:8.1f}s {now:8.1f}s {change:+8.1f}s  {name}")
    old_total = sum(test_seconds(t) for t in old["tests"].values())
    new_total = sum(test_seconds(t) for t in new["tests"].values())
    lines.append(f"{old_total:8.1f}s {new_total:8.1f}s {new_total - old_total:+8.1f}s  all files")
    return lines


def file_seconds(record: dict) -> dict[str, dict[str, float]]:
    """Each file's seconds per tier, the costliest first: what ``--save-order`` writes."""
    seconds: dict[str, dict[str, float]] = defaultdict(dict)
    for nodeid, test in record["tests"].items():
        tiers = seconds[file_of(nodeid)]
        tiers[test["tier"]] = tiers.get(test["tier"], 0.0) + test_seconds(test)
    ranked = sorted(seconds.items(), key=lambda item: -sum(item[1].values()))
    return {name: {tier: round(s, 1) for tier, s in sorted(tiers.items())} for name, tiers in ranked}


def costliest_files_first(items: list, seconds: dict[str, dict[str, float]]) -> list:
    """``items`` (pytest's, already deselected) grouped by file, the files with the most seconds in the tiers being
    run first; a file ``seconds`` does not know first of all; within a file and between equal files the collection
    order stays."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(file_of(item.nodeid), []).append(item)

    def cost(name: str) -> float:
        if name not in seconds:
            return float("inf")
        tiers = {"slow" if "slow" in item.keywords else "fast" for item in files[name]}
        return sum(seconds[name].get(tier, 0.0) for tier in tiers)

    return [item for name in sorted(files, key=lambda name: -cost(name)) for item in files[name]]


def load(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file (a pytest run writes it: python -m pytest ...)") from None
    except json.JSONDecodeError as err:
        raise SystemExit(f"{path}: not a durations record ({err})") from None
    if not isinstance(record, dict) or "tests" not in record:
        raise SystemExit(f"{path}: not a durations record (no 'tests')")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durations", description=__doc__.split("\n\n")[0])
    parser.add_argument("record", nargs="?", type=Path, default=DEFAULT_FILE,
                        help=f"a run's durations file (default: {DEFAULT_FILE.name} at the repository root)")
    parser.add_argument("--top", type=int, default=30, help="how many of the slowest tests (default 30)")
    parser.add_argument("--files", type=int, default=15, help="how many of the costliest files (default 15)")
    parser.add_argument("--tier", choices=("fast", "slow"), help="only this tier's tests and files")
    parser.add_argument("--by", choices=tuple(MEASURES), default="wall",
                        help="rank tests and files by wall seconds (default) or CPU seconds")
    parser.add_argument("--against", type=Path, help="an earlier run's file: per-file differences instead")
    parser.add_argument("--save-order", action="store_true",
                        help="write the record's seconds per file and tier to tests/file_seconds.json "
                             "(the order the workers get the files in; from a run of the whole suite)")
    args = parser.parse_args(argv)
    record = load(args.record)
    if args.save_order:
        if {t["tier"] for t in record["tests"].values()} != {"fast", "slow"}:
            raise SystemExit(f"{args.record}: not a run of both tiers; --save-order wants the whole suite's")
        tmp = ORDER_FILE.with_name(ORDER_FILE.name + ".tmp")
        tmp.write_text(json.dumps(file_seconds(record), indent=1) + "\n")
        os.replace(tmp, ORDER_FILE)
        print(f"{ORDER_FILE}: {len(record['tests'])} tests in "
              f"{len(by_file(record['tests']))} files")
        return 0
    lines = (comparison(record, load(args.against), args.files) if args.against
             else summary(record, args.top, args.files, args.tier, args.by))
    print("\n".join(lines))
    return 0


# --- the plugin -------------------------------------------------------------------------------------------------


def pytest_addoption(parser) -> None:
    group = parser.getgroup("durations record (tests/durations.py)")
    group.addoption("--durations-file", default=str(DEFAULT_FILE),
                    help="where to write every test's setup/call/teardown seconds ('' writes nothing)")
    group.addoption("--slowest", type=int, default=None,
                    help=f"print the tiers' totals and this many slowest tests at the end (default: 30 for a run "
                         f"of {SUMMARY_FROM} tests or more; 0: none)")


class Recorder:
    def __init__(self, config) -> None:
        self.config = config
        self.tests: dict[str, dict] = {}
        self.started, self.epoch = time.monotonic(), time.time()

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, {"tier": "slow" if "slow" in report.keywords else "fast",
                                                     "outcome": "passed"})
        test[report.when] = round(test.get(report.when, 0.0) + report.duration, 4)
        cpu = dict(report.user_properties).get(CPU_PROPERTY)
        if cpu is not None:
            test["cpu"] = round(test.get("cpu", 0.0) + cpu, 3)
        if report.start:  # epoch seconds (a worker's clock is this machine's)
            test.setdefault("start", round(report.start - self.epoch, 2))
            test["stop"] = round(report.stop - self.epoch, 2)
        if report.failed:
            test["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and test["outcome"] == "passed":
            test["outcome"] = "skipped"

    def record(self) -> dict:
        workers = getattr(self.config.option, "numprocesses", None) or 1
        return {"wall_seconds": round(time.monotonic() - self.started, 2), "workers": workers,
                "cpu_count": os.cpu_count(), "tests": self.tests}

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        target = self.config.getoption("durations_file")
        if not target or not self.tests or hasattr(self.config, "workerinput"):  # xdist: the controller writes
            return
        path = Path(target)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.record(), indent=1, sort_keys=True))
        os.replace(tmp, path)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput") or not self.tests:
            return
        top = self.config.getoption("slowest")
        if top is None:
            top = 30 if len(self.tests) >= SUMMARY_FROM else 0
        if top <= 0:
            return
        terminalreporter.write_sep("=", "where the time went (python -m tests.durations reads it again)")
        for line in summary(self.record(), top=top):
            terminalreporter.write_line(line)


def pytest_configure(config) -> None:
    config.pluginmanager.register(Recorder(config), "mmcse-durations")


CPU_PROPERTY = "mmcse_cpu_seconds"  # a report's user property: travels from an xdist worker to the controller
_cpu_mark: dict[str, float] = {}  # nodeid -> the process's CPU seconds when its current phase began


def _cpu_now() -> float:
    """This process's CPU seconds and those of its children it waited for (a stage, a server stopped by the test)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def pytest_runtest_logstart(nodeid, location) -> None:
    _cpu_mark[nodeid] = _cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    now = _cpu_now()
    used = now - _cpu_mark.get(item.nodeid, now)
    _cpu_mark[item.nodeid] = now
    # a new list: pytest hands every phase's report the item's own list
    report.user_properties = [*report.user_properties, (CPU_PROPERTY, round(used, 3))]


def pytest_runtest_logfinish(nodeid, location) -> None:
    _cpu_mark.pop(nodeid, None)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselected: the cost of the tiers that run
def pytest_collection_modifyitems(config, items) -> None:
    """pytest-xdist hands out files in this order (pyproject's ``--dist loadfile --no-loadscope-reorder``: a file's
    tests on one worker, so a module-scoped fixture is set up once); every worker computes the same order."""
    try:
        seconds = json.loads(ORDER_FILE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        seconds = {}  # collection order
    items[:] = costliest_files_first(items, seconds)


if __name__ == "__main__":
    sys.exit(main())
