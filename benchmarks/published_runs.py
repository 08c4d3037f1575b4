"""The planner against published GPU runs: predicted vs measured tokens/s per GPU and peak memory.

Reads ``benchmarks/published/runs.json`` (each run's source, stack, hardware, layout and published
figures), prices each layout with the planner (``lightning_ultrascale.plan.estimate``, the run's
precision and gradient reduction), prints the table and writes
``benchmarks/results/published_runs.json``. Nothing runs on a GPU: this compares the cost model
with what others measured. Tokens/s per GPU is compared, not MFU (FLOP-counting conventions differ).

    python benchmarks/published_runs.py      # seconds, one CPU process
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.plan.cost import Candidate, Workload, estimate
from lightning_ultrascale.plan.hardware import get_hardware

ROOT = Path(__file__).resolve().parent
RUNS = ROOT / "published" / "runs.json"
RESULTS = ROOT / "results" / "published_runs.json"
GIB = 2**30


def gpus(data: dict[str, Any]) -> dict[str, Any]:
    """The profiles the runs name beyond the built-in ones (keys starting with ``_`` are notes)."""
    return {name: {k: v for k, v in spec.items() if not k.startswith("_")} for name, spec in data["gpus"].items()}


def predict(run: dict[str, Any], profiles: dict[str, Any]) -> dict[str, Any]:
    """The planner's tokens/s per GPU, MFU and peak memory (worst rank) for one published run."""
    gpu = get_hardware(profiles.get(run["gpu"], run["gpu"]))
    workload = Workload(
        get_model_config(run["model"]), run["seq_len"], run["global_batch_size"],
        precision=run["precision"], reduce_dtype=run["reduce_dtype"],
    )  # fmt: skip
    candidate = Candidate.layout(**run["layout"], reduce_dtype=run["reduce_dtype"])
    costs = estimate(workload, candidate, build_model(run["model"], device="meta"), gpu)
    worst = max(costs, key=lambda c: c.peak)
    return {
        "layout": candidate.label(),
        "tokens_per_s_per_gpu": min(c.tokens_per_s for c in costs) / candidate.world_size,
        "mfu": min(c.mfu for c in costs),
        "peak_memory_gib": worst.peak / GIB,
        "fits": worst.peak <= gpu.usable_bytes,
        "memory_gib": {k: v / GIB for k, v in worst.memory.items()},
    }


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for run in data["runs"]:
        predicted = predict(run, gpus(data))
        measured = run["measured"]
        ratio = predicted["tokens_per_s_per_gpu"] / measured["tokens_per_s_per_gpu"]
        memory = measured.get("peak_memory_gib")
        out.append(
            {
                "name": run["name"], "source": run["source"], "predicted": predicted, "measured": measured,
                "throughput_ratio": ratio,
                "memory_ratio": predicted["peak_memory_gib"] / memory if memory else None,
            }
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same (it takes seconds); for the test suite")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    data = json.loads(RUNS.read_text())
    table = rows(data)
    print("Planner vs published runs: tokens/s per GPU (predicted / measured) and peak memory")
    print(f"{'run':<40} {'layout':<52} {'pred tok/s':>10} {'meas':>7} {'ratio':>6} {'peak GiB':>9} {'meas':>6}")
    for r in table:
        p, m = r["predicted"], r["measured"]
        meas_mem = f"{m['peak_memory_gib']:.1f}" if m.get("peak_memory_gib") else "-"
        print(
            f"{r['name']:<40} {p['layout']:<52} {p['tokens_per_s_per_gpu']:>10,.0f} {m['tokens_per_s_per_gpu']:>7,}"
            f" {r['throughput_ratio']:>6.2f} {p['peak_memory_gib']:>9.1f} {meas_mem:>6}"
        )
    errors = [abs(r["throughput_ratio"] - 1) for r in table]
    summary = {
        "median_abs_throughput_error": statistics.median(errors),
        "max_abs_throughput_error": max(errors),
        "median_throughput_ratio": statistics.median(r["throughput_ratio"] for r in table),
    }
    print(
        f"\nthroughput: median |error| {summary['median_abs_throughput_error']:.0%}, worst "
        f"{summary['max_abs_throughput_error']:.0%}, median predicted/measured {summary['median_throughput_ratio']:.2f}"
    )
    payload = {"benchmark": "published_runs", "quick": args.quick, "runs": table, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
