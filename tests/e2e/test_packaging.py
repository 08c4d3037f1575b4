"""A wheel of this checkout is a real package: installed in a fresh venv, its commands run from any directory.

Marked slow (29 s measured on 2 CPU cores: the wheel and venv 2 s, two training steps on 2 processes 12 s, a
layout dry run 5 s, two imports of the package 11 s), and in the default suite all the same.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


class Installed(NamedTuple):
    venv: Path
    package: Path  # where the wheel put lightning_ultrascale/
    version: str  # the wheel's


def _run(*command: object, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    # No PYTHONPATH: it could point at the checkout (a test run from a worktree often sets it).
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(c) for c in command], cwd=cwd, env={**environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from this checkout, alone in a fresh venv; torch and the rest come from this environment.

    The build runs on a copy of what it reads, so setuptools' build/ and egg-info stay out of the
    checkout (and no stale build/lib file slips into the wheel). ``--system-site-packages`` would give
    the base interpreter's packages, not this venv's: a ``.pth`` file adds this environment's instead
    (offline, nothing copied), written after the install so that pip sees an empty venv.
    """
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    package = "lightning_ultrascale"
    shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist, src, cwd=tmp)
    (wheel,) = dist.glob("lightning_ultrascale-*.whl")
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    _run(*pip, "--python", python, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(purelib) / "_test_environment.pth").write_text("\n".join(ours) + "\n")
    return Installed(venv, Path(purelib) / package, wheel.name.split("-")[1])


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A working directory outside the repository."""
    assert not tmp_path.resolve().is_relative_to(ROOT)
    return tmp_path


def test_the_installed_package_is_imported_with_its_version_configs_and_recipes(installed, elsewhere):
    show = "import lightning_ultrascale as lu; print(lu.__file__); print(lu.__version__)"
    file, version = _run(installed.venv / "bin" / "python", "-c", show, cwd=elsewhere).stdout.split()
    assert Path(file) == installed.package / "__init__.py" and version == installed.version
    assert (installed.package / "conf" / "train.yaml").is_file()
    recipes = Path(_run(installed.venv / "bin" / "ultrascale-train", "--recipes-dir", cwd=elsewhere).stdout.strip())
    assert recipes == installed.package / "recipes" and (recipes / "llama3_8b.yaml").is_file()
    for script in ("torchrun.sh", "slurm.sbatch"):  # launch scripts users copy; the wheel keeps them executable
        assert os.access(recipes / script, os.X_OK)


def test_two_steps_of_the_default_job_train_from_any_directory(installed, elsewhere):
    run = elsewhere / "run"
    overrides = ["trainer.max_steps=2", "data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4",
                 "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]  # fmt: skip
    _run(installed.venv / "bin" / "ultrascale-train", *overrides, cwd=elsewhere, ULTRASCALE_RUN_DIR=str(run))
    assert (run / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    # Hydra records where the config came from: the installed package's conf/.
    assert f"path: {installed.package / 'conf'}\n" in (run / ".hydra" / "hydra.yaml").read_text()


def test_the_planner_dry_runs_a_packaged_recipe_from_any_directory(installed, elsewhere):
    out = _run(installed.venv / "bin" / "ultrascale-plan", "--check", "recipe=llama_tiny_cpu", cwd=elsewhere)
    assert out.stdout.count("= planner") == 2, out.stdout
