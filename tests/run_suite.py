"""Run the test suite as one plain pytest process per core ("lanes"), each on a share of the modules.

    .venv/bin/python tests/run_suite.py                     # the README's test command (.ci/run)
    .venv/bin/python tests/run_suite.py tests/unit          # only these folders or modules
    .venv/bin/python tests/run_suite.py -- -x -k zero       # options after -- go to every lane
    .venv/bin/python tests/run_suite.py --record            # also rewrite tests/data/durations.json

`python -m pytest` runs the same tests in one process (about 20 minutes on 2 cores; this, 12 to 14).

Why not pytest-xdist: its workers run execnet's I/O threads, and a rank that a test forks from a
process with threads in it can die in glibc with SIGABRT (it did, in every fresh-clone run of the suite
under `pytest -n auto`). A lane here is a plain pytest process, kept single-threaded by `conftest.py`,
so forking ranks from it stays safe.

Modules are dealt longest first, each to the least loaded lane (LPT scheduling), by the seconds each
took in a recorded run (`tests/data/durations.json`; a module not recorded counts as the median). A
module is never split: its warm worker pool and module fixtures are set up once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "data" / "durations.json"
#: More lanes than this would hold that many pools of warm workers (a few GiB each) at once.
MAX_LANES = 4


def find_modules(paths: list[str]) -> list[str]:
    """The test modules under ``paths`` (folders or files, relative to the root), sorted, as posix paths."""
    found: list[str] = []
    for name in paths:
        path = (ROOT / name).resolve()
        if path.is_dir():
            found += [p.relative_to(ROOT).as_posix() for p in path.rglob("test_*.py")]
        elif path.is_file() and path.suffix == ".py":
            found.append(path.relative_to(ROOT).as_posix())
        else:
            raise SystemExit(f"run_suite: {name!r} is neither a folder nor a test module under {ROOT}")
    return sorted(set(found))


def deal(modules: list[str], seconds: dict[str, float], lanes: int) -> list[list[str]]:
    """Modules dealt to ``lanes`` lanes, longest first onto the least loaded (empty lanes dropped).

    >>> deal(["a", "b", "c", "d"], {"a": 5.0, "b": 4.0, "c": 3.0, "d": 2.0}, 2)
    [['a', 'd'], ['b', 'c']]
    """
    if lanes < 1:
        raise ValueError(f"run_suite: --lanes must be a positive integer, got {lanes}")
    known = [seconds[m] for m in modules if m in seconds]
    default = statistics.median(known) if known else 1.0
    cost = {m: seconds.get(m, default) for m in modules}
    loads = [0.0] * lanes
    dealt: list[list[str]] = [[] for _ in range(lanes)]
    for module in sorted(modules, key=lambda m: (-cost[m], m)):
        lane = loads.index(min(loads))
        dealt[lane].append(module)
        loads[lane] += cost[module]
    return [sorted(lane) for lane in dealt if lane]


@dataclass
class Lane:
    """One pytest process running its share of the modules; its report lands in ``junit``."""

    number: int
    modules: list[str]
    junit: Path
    process: subprocess.Popen[str] | None = None
    printer: threading.Thread | None = None

    def start(self, options: list[str], total: int) -> None:
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                f"--junitxml={self.junit}", *options, *self.modules]  # fmt: skip
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True)  # fmt: skip
        self.printer = threading.Thread(target=self._print, args=(f"[{self.number}/{total}] ",), daemon=True)
        self.printer.start()

    def _print(self, prefix: str) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()

    def wait(self) -> int:
        """The lane's exit code, once pytest has exited; what it left running is killed.

        A process a test forked and never reaped would hold the lane's output pipe open (the printer
        would wait for it forever: a CI run that never ends), so the lane's session is killed here
        and the leak is named.
        """
        assert self.process is not None and self.printer is not None
        code = self.process.wait()
        left = _session_members(self.process.pid)
        if left:
            print(f"run_suite: lane {self.number} left {len(left)} processes running after pytest exited "
                  f"(pids {sorted(left)}): killed; a test leaks processes", flush=True)  # fmt: skip
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        self.printer.join(timeout=30)
        return code

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)


def _session_members(session: int) -> list[int]:
    """The processes still in ``session`` (a lane starts one of its own), read from /proc where there is one."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":  # (state, ppid, pgrp, session, ...)
                members.append(int(entry.parent.name))
    return members


def read_reports(junits: list[Path]) -> tuple[dict[str, int], dict[str, float]]:
    """Counts (tests, failures, errors, skipped) summed over the lanes' reports, and seconds per module."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    seconds: dict[str, float] = {}
    for junit in junits:
        if not junit.exists():
            continue
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                module = case.get("file") or ""
                if module:
                    seconds[module] = seconds.get(module, 0.0) + float(case.get("time", 0.0))
    return counts, seconds


def record(seconds: dict[str, float]) -> None:
    """Merge a run's seconds per module into ``tests/data/durations.json`` (modules gone are dropped)."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    recorded.update({m: round(s, 1) for m, s in seconds.items()})
    current = set(find_modules(["tests"]))
    kept = {m: recorded[m] for m in sorted(recorded) if m in current}
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"run_suite: recorded the seconds of {len(seconds)} modules in {DURATIONS.relative_to(ROOT)}")


def run(modules: list[str], lanes: int, options: list[str], scratch: Path) -> tuple[int, list[Path]]:
    """Run the lanes side by side; the exit code is the first failing lane's (0 when all passed)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    dealt = deal(modules, seconds, lanes)
    started = [Lane(i + 1, share, scratch / f"lane{i + 1}.xml") for i, share in enumerate(dealt)]
    for lane in started:
        print(f"run_suite: lane {lane.number}/{len(dealt)} runs {len(lane.modules)} modules")
        lane.start(options, len(dealt))
    try:
        codes = [lane.wait() for lane in started]
    except KeyboardInterrupt:
        for lane in started:
            lane.stop()
        raise
    for lane, code in zip(started, codes):
        print(f"run_suite: lane {lane.number}/{len(dealt)} exited {code}")
    return combined_exit(codes), [lane.junit for lane in started]


def combined_exit(codes: list[int]) -> int:
    """The first failing lane's exit code, 0 when all passed. pytest's 5 (no tests collected) in one lane
    is no failure where another lane ran tests (a ``-k`` or ``-m`` that selects none of its modules).

    >>> combined_exit([0, 5]), combined_exit([5, 5]), combined_exit([0, 1, 2])
    (0, 5, 1)
    """
    failing = [c for c in codes if c not in (0, 5)] or ([5] if all(c == 5 for c in codes) else [])
    return failing[0] if failing else 0


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    options = args[args.index("--") + 1 :] if "--" in args else []
    ours = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="folders or test modules (default: tests)")
    parser.add_argument("--lanes", type=int, default=min(MAX_LANES, len(os.sched_getaffinity(0))),
                        help="pytest processes side by side (default: one per usable core, at most 4)")  # fmt: skip
    parser.add_argument("--record", action="store_true", help="rewrite tests/data/durations.json from this run")
    parsed = parser.parse_args(ours)
    modules = find_modules(parsed.paths)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run_suite-") as scratch:
        code, junits = run(modules, parsed.lanes, options, Path(scratch))
        counts, seconds = read_reports(junits)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"run_suite: {passed} passed, {counts['skipped']} skipped, {counts['failures']} failed, "
          f"{counts['errors']} errors in {time.monotonic() - began:.0f} s (exit {code})")  # fmt: skip
    if parsed.record:
        record(seconds)
    return code


if __name__ == "__main__":
    sys.exit(main())
