"""Test-wide setup.

Multi-process tests fork gloo workers (lightning_ultrascale.testing.run_workers). Forking is only
safe while the parent has not started its intra-op thread pool, and is fastest when the parent
has already imported the distributed packages the workers use (0.25 s instead of 10 s for two
workers), so both happen here, before any test module runs.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# tokenizers' Rust thread pool starts at the first batch encode and stays: every later fork would copy
# a parent with those threads in it (a malloc crash in a forked worker, once in CI).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's first compile on a cold cache (a fresh machine: /tmp/torchinductor_$USER empty) starts a
# thread pool that stays; every later fork then failed the check for threads. One thread compiles here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# transformers' from_pretrained loads weights on a thread pool it shuts down without waiting: a test that
# loads a model and then forks ranks could fork while those threads still run (ForkWithThreadsWarning).
os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")

# tqdm's monitor thread (started by the first progress bar a test shows in this process) would be
# alive in the parent at every later fork: measured there, the one thread besides the main one.
try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass

# The tiers (unit/, multiprocess/, e2e/) share the helper modules beside this file (llama_runs.py, ...).
sys.path.insert(0, str(Path(__file__).parent))

import torch

torch.set_num_threads(1)

# Without a GPU, Triton kernels (lightning_ultrascale.kernels) run in Triton's interpreter on CPU
# tensors. Triton reads this when a kernel is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed.fsdp  # noqa: E402
import torch.distributed.pipelining  # noqa: E402
import torch.distributed.tensor  # noqa: E402

from lightning_ultrascale.data.corpus import load_default_corpus_documents  # noqa: E402

load_default_corpus_documents()  # encoded once here: every forked rank inherits it (~2,000 ranks read it)


def _observe_children_only(launch):  # type: ignore[no-untyped-def]
    def observer(child_processes):  # type: ignore[no-untyped-def]
        if child_processes:
            launch(child_processes)

    return observer


# Lightning's launcher starts a thread that watches the ranks it started, also when it started none (an
# in-process fit on one device); the thread lives 5 s more, and a test forking ranks within them failed
# the suite's check for threads (lightning_ultrascale/testing/spawn.py). Here it starts only with ranks to watch.
import lightning.fabric.strategies.launchers.subprocess_script as _fabric_launcher  # noqa: E402
import lightning.pytorch.strategies.launchers.subprocess_script as _trainer_launcher  # noqa: E402

_fabric_launcher._launch_process_observer = _observe_children_only(_fabric_launcher._launch_process_observer)
_trainer_launcher._launch_process_observer = _observe_children_only(_trainer_launcher._launch_process_observer)

#: Packages the GPU machine's image lacks (it has torch, triton, lightning and transformers). A test module
#: that imports one is skipped where it is missing, so `pytest -m gpu` collects from the repository root
#: there (it aborted with collection errors before); everywhere else they are installed and nothing changes.
OPTIONAL_PACKAGES = ("hydra", "omegaconf", "torchao")


class _SkippedWithoutOptionalPackages(pytest.Module):
    def _getobj(self):  # type: ignore[no-untyped-def]
        try:
            return super()._getobj()
        except pytest.Collector.CollectError as error:
            missing = getattr(error.__cause__, "name", None) or ""
            if missing.split(".")[0] not in OPTIONAL_PACKAGES:
                raise
            pytest.skip(f"{self.path.name} needs {missing}, which is not installed", allow_module_level=True)


def pytest_configure(config):  # type: ignore[no-untyped-def]
    # A fork with threads in the parent is an error here (lightning_ultrascale/testing/spawn.py): this
    # process is kept single-threaded. Added here, not in pyproject.toml: naming the warning's class
    # there imports torch before OMP_NUM_THREADS above is set, and that starts the OpenMP pool.
    config.addinivalue_line("filterwarnings", "error::lightning_ultrascale.testing.spawn.ForkWithThreadsWarning")


def pytest_pycollect_makemodule(module_path, parent):  # type: ignore[no-untyped-def]
    if module_path.name == "conftest.py":
        return None
    return _SkippedWithoutOptionalPackages.from_parent(parent, path=module_path)


#: The checkout's root: the suite must leave it as it found it (a run directory's report written to the
#: working directory landed in the repository once and was committed).
ROOT = Path(__file__).resolve().parents[1]


def _changed_files() -> set[str] | None:
    """The checkout's changed and untracked files (``git status``), or None outside a git checkout.

    Python and Markdown files are left out: a developer may edit those while the suite runs.
    """
    if not (ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {line[3:] for line in out.splitlines() if not line.endswith((".py", ".md"))}


def pytest_sessionstart(session):  # type: ignore[no-untyped-def]
    session.config.stash[_BEFORE] = _changed_files()


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    before = session.config.stash.get(_BEFORE, None)
    after = _changed_files() if before is not None else None
    if before is None or after is None or not (after - before):
        return
    written = ", ".join(sorted(after - before))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"the suite wrote into the checkout (write under tmp_path instead): {written}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set[str] | None]()


@pytest.fixture(scope="module", autouse=True)
def _warm_workers():  # type: ignore[no-untyped-def]
    # Parity runs (testing.parity.record_run) of one test module share warm workers, one set per world
    # size (lightning_ultrascale/testing/pool.py): a layout's second run skips what its first paid for.
    from lightning_ultrascale.testing.pool import worker_pools

    with worker_pools():
        yield


@pytest.fixture(autouse=True)
def _fresh_workers_under_monkeypatch(request):  # type: ignore[no-untyped-def]
    # Warm workers were forked before this test patched anything: a test that patches (or uses a
    # fixture that does) runs its jobs on fresh processes, which see the patch.
    from lightning_ultrascale.testing.pool import fresh_workers

    with fresh_workers() if "monkeypatch" in request.fixturenames else contextlib.nullcontext():
        yield


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A byte-level token file of 600 short documents (3 to 40 bytes): ~3 per 64-token window."""
    import json
    from pydoc_data.topics import topics

    import torch

    from lightning_ultrascale.data.prepare import tokenize_corpus
    from lightning_ultrascale.data.tokenizer import load_tokenizer

    text = " ".join(topics[k] for k in sorted(topics))[:60_000]
    gen = torch.Generator().manual_seed(0)
    folder = tmp_path_factory.mktemp("short_documents")
    lines, start = [], 0
    for _ in range(600):
        n = int(torch.randint(3, 41, (1,), generator=gen))
        lines.append(json.dumps({"text": text[start : start + n]}))
        start += n
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tokenize_corpus([folder / "docs.jsonl"], folder / "docs.bin", load_tokenizer("byte"))
    return str(folder / "docs.bin")
