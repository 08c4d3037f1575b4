"""Load a script of ``benchmarks/`` as a module (its formulas and layouts), keeping this process's threads."""

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module; the script pins one thread for its workers, undone here."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        spec.loader.exec_module(bench)
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return bench
