"""Every ``>>>`` example in the package's docstrings runs, as ``pytest --doctest-modules lightning_ultrascale``.

Run in a subprocess: collecting doctests imports every module of the package, which the suite's parent process
must not do before it forks gloo workers (tests/conftest.py). The examples that need several processes, a GPU or
a model directory not on disk carry ``# doctest: +SKIP``; their count is held here, so a new one is a decision.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Examples skipped whole: Trainer fits over several processes, meshes and process groups, Hugging Face
#: directories (``/models/...``) that are not on this disk.
SKIPPED_EXAMPLES = 22


def test_every_docstring_example_runs():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--doctest-modules", "lightning_ultrascale", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "-o", "testpaths="],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    skipped = int(m.group(1)) if (m := re.search(r"(\d+) skipped", summary)) else 0
    assert passed >= 150, summary
    assert skipped == SKIPPED_EXAMPLES, f"{summary}: a new +SKIP example? update SKIPPED_EXAMPLES with its reason"
