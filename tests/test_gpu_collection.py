"""The GPU tier starts on the GPU image: torch, triton, lightning, transformers; no hydra, omegaconf, torchao."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import OPTIONAL_PACKAGES

ROOT = Path(__file__).resolve().parents[1]


def test_pytest_m_gpu_collects_from_the_root_without_hydra_omegaconf_and_torchao(tmp_path):
    # Packages that raise ModuleNotFoundError on import hide the installed ones; hydra's pytest plugin,
    # which the image would not have either, is turned off. Before: 7 collection errors, no GPU test ran.
    for name in OPTIONAL_PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError('hidden', name={name!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*command, "-p", "no:hydra_pytest"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "error" not in output.lower(), output[-4000:]
    assert sum(line.startswith("tests/test_gpu.py::") for line in output.splitlines()) >= 10, output[-4000:]
    assert all(f"needs {name}" in output for name in OPTIONAL_PACKAGES), output[-4000:]  # really hidden
