"""The planner against published GPU runs: predicted vs measured tokens/s per GPU and peak memory.

Reads ``benchmarks/published/runs.json`` (each run's source, stack, hardware, layout and published
figures), prices each layout with the planner (``lightning_ultrascale.plan.estimate``, the run's
precision and gradient reduction), prints the table and writes
``benchmarks/results/published_runs.json``. Nothing runs on a GPU: this compares the cost model
with what others measured. Tokens/s per GPU is compared, not MFU (FLOP-counting conventions differ).

A published stack's feature this library lacks is a named switch of the time model, on for the
runs whose stack has it and stated in ``runs.json`` with its source: ``ep_comm_overlap`` (Megatron's
combined 1F1B for Qwen3-235B), ``tp_comm_overlap`` (NeMo's 70B), ``recomputed_matmuls`` (torchtitan's
op-level recomputation re-runs every second matmul). Roles: a run marked ``fit`` is the one the H100
profile's ``matmul_efficiency`` was fitted on (:func:`fit_matmul_efficiency` reproduces it); one marked
``memory`` is judged on memory only (its GPU's peak is not published); one marked ``shown`` is printed and
not judged (its role says why: a benchmark setting the planner does not model); every other run is judged
on throughput with datasheet constants and that one fitted figure. A run this library would not fit in its
GPU's memory says why (``memory_not_comparable``): the planner's memory is this library's, and such a run is
judged on throughput only. FP8 runs name their recipe (``fp8``), priced by ``plan.fp8``.

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


def data_kernels_fused(run: dict[str, Any]) -> bool:
    """The run's stack fuses its memory-bound ops (``"kernels": "fused"``: Transformer Engine, torch.compile)."""
    return run.get("kernels", "eager") == "fused"


def predict(run: dict[str, Any], profiles: dict[str, Any]) -> dict[str, Any]:
    """The planner's tokens/s per GPU, MFU and peak memory (worst rank) for one published run."""
    gpu = get_hardware(profiles.get(run["gpu"], run["gpu"]))
    workload = Workload(
        get_model_config(run["model"]), run["seq_len"], run["global_batch_size"],
        precision=run["precision"], reduce_dtype=run["reduce_dtype"], fused_kernels=data_kernels_fused(run),
        tp_comm_overlap=run.get("tp_comm_overlap", False),  # a stack's TP overlap: a named switch, stated per run
        ep_comm_overlap=run.get("ep_comm_overlap", False),  # a stack's EP all-to-all overlap: the same
        fp8=run.get("fp8"), force_balanced=run.get("force_balanced", False),  # FP8 recipe; forced MoE routing
        recomputed_matmuls=run.get("recomputed_matmuls", 0.0),  # matmuls a stack's op-level recomputation re-runs
    )  # fmt: skip
    candidate = Candidate.layout(**run["layout"], reduce_dtype=run["reduce_dtype"])
    costs = estimate(workload, candidate, build_model(run["model"], device="meta"), gpu)
    worst = max(costs, key=lambda c: c.peak)
    return {
        "layout": candidate.label(),
        "tp_comm_overlap": workload.tp_comm_overlap,
        "ep_comm_overlap": workload.ep_comm_overlap,
        "tokens_per_s_per_gpu": min(c.tokens_per_s for c in costs) / candidate.world_size,
        "mfu": min(c.mfu for c in costs),
        "peak_memory_gib": worst.peak / GIB,
        "fits": worst.peak <= gpu.usable_bytes,
        "memory_gib": {k: v / GIB for k, v in worst.memory.items()},
    }


def fit_matmul_efficiency(run: dict[str, Any], profiles: dict[str, Any]) -> float:
    """The ``matmul_efficiency`` of ``run``'s GPU at which the planner predicts its measured throughput."""
    from dataclasses import replace

    base, measured = get_hardware(profiles.get(run["gpu"], run["gpu"])), run["measured"]["tokens_per_s_per_gpu"]
    low, high = 0.2, 1.0
    for _ in range(40):  # bisection: throughput rises with the efficiency
        mid = (low + high) / 2
        predicted = predict(run, {run["gpu"]: replace(base, matmul_efficiency=mid)})["tokens_per_s_per_gpu"]
        low, high = (mid, high) if predicted < measured else (low, mid)
    return (low + high) / 2


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for run in data["runs"]:
        predicted = predict(run, gpus(data))
        measured = run["measured"]
        ratio = predicted["tokens_per_s_per_gpu"] / measured["tokens_per_s_per_gpu"]
        memory = measured.get("peak_memory_gib")
        out.append(
            {
                "name": run["name"], "source": run["source"], "role": run.get("role", "judged").split(":")[0],
                "predicted": predicted, "measured": measured,
                "throughput_ratio": ratio,
                "memory_ratio": predicted["peak_memory_gib"] / memory if memory else None,
                "memory_not_comparable": run.get("memory_not_comparable"),
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
    head = f"{'run':<40} {'role':<7} {'layout':<52} {'pred tok/s':>10} {'meas':>7}"
    print(f"{head} {'ratio':>6} {'peak GiB':>9} {'meas':>6}")
    for r in table:
        p, m = r["predicted"], r["measured"]
        meas_mem = f"{m['peak_memory_gib']:.1f}" if m.get("peak_memory_gib") else "-"
        print(
            f"{r['name']:<40} {r['role']:<7} {p['layout']:<52} {p['tokens_per_s_per_gpu']:>10,.0f}"
            f" {m['tokens_per_s_per_gpu']:>7,.0f}"
            f" {r['throughput_ratio']:>6.2f} {p['peak_memory_gib']:>9.1f} {meas_mem:>6}"
        )
    summary = _summary(data, table)
    print(
        f"\nthroughput of the {summary['judged']} judged runs: median |error| "
        f"{summary['median_abs_throughput_error']:.1%}, worst {summary['max_abs_throughput_error']:.1%}; "
        f"H100 matmul_efficiency fitted on {summary['fit_run']}: {summary['fitted_h100_matmul_efficiency']:.3f}"
    )
    payload = {"benchmark": "published_runs", "quick": args.quick, "runs": table, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


def _summary(data: dict[str, Any], table: list[dict[str, Any]]) -> dict[str, Any]:
    judged = [r for r in table if r["role"] == "judged"]
    errors = [abs(r["throughput_ratio"] - 1) for r in judged]
    memory = [abs(r["memory_ratio"] - 1) for r in table if r["memory_ratio"] is not None]
    [fit] = [run for run in data["runs"] if run.get("role", "").startswith("fit")]
    return {
        "judged": len(judged),
        "median_abs_throughput_error": statistics.median(errors),
        "max_abs_throughput_error": max(errors),
        "max_abs_memory_error": max(memory),
        "fit_run": fit["name"],
        "fitted_h100_matmul_efficiency": fit_matmul_efficiency(fit, gpus(data)),
    }


if __name__ == "__main__":
    main()
