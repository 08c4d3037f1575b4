"""The code base stays ruff-clean (ruff comes with the dev extra, like pytest)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_reports_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "lightning_ultrascale", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
