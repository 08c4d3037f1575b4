"""The suite's runner (tests/run_suite.py): modules dealt to lanes by recorded seconds, reports combined."""

import json
import subprocess
import sys

import pytest
import run_suite


def test_every_module_is_dealt_to_exactly_one_lane_longest_first_onto_the_least_loaded():
    seconds = {f"m{i}": float(s) for i, s in enumerate([50, 40, 30, 20, 10, 10])}
    lanes = run_suite.deal(sorted(seconds), seconds, 2)
    assert sorted(m for lane in lanes for m in lane) == sorted(seconds)
    loads = [sum(seconds[m] for m in lane) for lane in lanes]
    assert loads == [80.0, 80.0]  # 50+20+10 and 40+30+10: LPT balances this set exactly


def test_a_module_without_recorded_seconds_counts_as_the_median_and_empty_lanes_are_dropped():
    assert run_suite.deal(["a", "new"], {"a": 3.0}, 4) == [["a"], ["new"]]
    assert run_suite.deal(["a", "b", "new"], {"a": 9.0, "b": 1.0}, 2) == [["a"], ["b", "new"]]
    with pytest.raises(ValueError, match="--lanes must be a positive integer, got 0"):
        run_suite.deal(["a"], {}, 0)


def test_the_recorded_seconds_name_only_modules_that_exist():
    recorded = json.loads(run_suite.DURATIONS.read_text())
    gone = set(recorded) - set(run_suite.find_modules(["tests"]))
    assert not gone, f"tests/data/durations.json names modules that are gone: {sorted(gone)} (run --record)"


def test_a_path_that_is_neither_a_folder_nor_a_module_is_refused_by_name():
    with pytest.raises(SystemExit, match="'tests/nowhere' is neither a folder nor a test module"):
        run_suite.find_modules(["tests/nowhere"])


def test_lanes_exit_codes_combine_into_the_first_failure():
    assert run_suite.combined_exit([0, 0]) == 0
    assert run_suite.combined_exit([0, 5]) == 0  # a lane whose modules a -k left empty
    assert run_suite.combined_exit([5, 5]) == 5
    assert run_suite.combined_exit([0, 2, 1]) == 2


def test_the_reports_pytest_writes_give_the_counts_and_seconds_per_module(tmp_path):
    module = tmp_path / "test_tiny.py"
    module.write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip('no')\n"
        "def test_skipped(): pass\n"
    )
    junit = tmp_path / "lane1.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            f"--junitxml={junit}", str(module)]  # fmt: skip
    assert subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=120).returncode == 1
    counts, seconds = run_suite.read_reports([junit, tmp_path / "missing.xml"])
    assert counts == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}
    assert list(seconds) == ["test_tiny.py"] and seconds["test_tiny.py"] >= 0.0


def test_a_lane_whose_test_leaves_a_process_running_still_ends_and_names_the_leak(tmp_path, capsys):
    # A forked process that outlives pytest holds the lane's output pipe: before, the runner waited for
    # it forever (a CI run cut at its time limit). Now the lane's session is killed once pytest exits.
    module = tmp_path / "test_leak.py"
    module.write_text(
        "import subprocess, sys\n"
        "def test_leaves_a_sleeper():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    )
    lane = run_suite.Lane(1, [str(module)], tmp_path / "lane1.xml")
    lane.start(["-q"], 1)
    assert lane.wait() == 0
    out = capsys.readouterr().out
    assert "left 1 processes running after pytest exited" in out and "killed; a test leaks processes" in out


def test_a_forked_process_does_not_inherit_the_parent_s_worker_pools():
    import os

    from lightning_ultrascale.testing import pool

    with pool.worker_pools():
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(write, b"none" if pool._pools is None else b"pools")
            os._exit(0)
        os.waitpid(child, 0)
        assert os.read(read, 8) == b"none" and pool._pools == {}
