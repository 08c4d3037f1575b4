"""The code base stays ruff-clean (ruff comes with the dev extra, like pytest)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_reports_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "lightning_ultrascale", "tests", "benchmarks", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


FUNCTION_LINES, STRATEGY_LINES = 50, 350


def test_functions_stay_short_and_the_strategy_small():
    """Every function within 50 lines (``def`` to its last line, docstring included); strategy.py within 350."""
    package = ROOT / "lightning_ultrascale"
    long = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = (path.relative_to(package).as_posix(), node.name)
                if lines > FUNCTION_LINES:
                    long[where] = lines
    assert not long, f"functions over {FUNCTION_LINES} lines (split them): {long}"
    strategy = len((package / "core" / "strategy.py").read_text().splitlines())
    assert strategy <= STRATEGY_LINES, f"strategy.py has {strategy} lines (limit {STRATEGY_LINES}): move a part out"
