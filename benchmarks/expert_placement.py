"""Expert placement from measured load (EPLB): the balance a re-placement leaves, against the aux-loss-free bias alone.

Prints a table and writes ``benchmarks/results/expert_placement.json``. moe_tiny (8 routed experts in 4
groups of 2, top-2 from 2 groups, 3 MoE blocks; fp32) with ``benchmarks/expert.py``'s skewed router (most
rows to experts 0 and 2, max/mean about 3.8 at step 0) trains on one process with AdamW, in two runs:
the aux-loss-free bias alone (rate 3e-3, no aux loss: ``expert.py``'s ``aux_free_bias``) and no balancing
at all (the skew stays). Every optimizer step records each MoE block's global tokens per expert
(``LlamaModule.expert_stats.loads``). Routing is the same in every layout (the expert-parallel parity
tests prove it), so the rows each expert-parallel rank receives follow from these loads exactly: the sum
of its experts' rows (a replicated expert's split evenly over its replicas).

Per step, the busiest rank's rows over the mean (averaged over the MoE blocks; each block waits for its
busiest rank) at ep = 2 and 4, under:

- ``contiguous``: expert parallelism's own placement (experts ``r E/ep ..`` on rank ``r``), what runs today;
- ``eplb_r0``: EPLB's placement without redundant experts (a re-packing), and ``eplb_r{ep}``: with ``ep``
  redundant slots (one more per rank), each re-computed every ``EVERY`` steps from the loads of the
  ``EVERY`` steps before (:func:`~lightning_ultrascale.parallel.expert.placement.balance_experts`, one
  node; the first ``EVERY`` steps run contiguous): what a re-placement at that interval would leave on the
  steps it serves, measured on loads it has not seen.

Step time: not measured. Expert parallelism does not yet move experts to a placement during training,
so no step ran under one; the busiest rank's rows are what the step's expert compute waits for, and the
planner prices the ratio as ``Workload.expert_load`` (``plan.expert_load(loads, ep, redundant=R)``).

    python benchmarks/expert_placement.py            # ~3 minutes on 2 CPU cores
    python benchmarks/expert_placement.py --quick    # a smoke run for the test suite
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from expert import MOE, balance_worker

from lightning_ultrascale.parallel.expert.placement import ExpertPlacement, balance_experts
from lightning_ultrascale.testing.spawn import run_workers

RESULTS = Path(__file__).parent / "results" / "expert_placement.json"
#: Re-place every this many optimizer steps, from the loads of the steps since the last re-placement.
EVERY = 10
#: The two runs: the aux-loss-free bias alone (expert.py's aux_free_bias rate), and no balancing.
METHODS = {
    "aux_free_bias": dataclasses.replace(MOE, aux_loss="none", bias_update_rate=3e-3),
    "neither": dataclasses.replace(MOE, aux_loss="none", bias_update_rate=0.0),
}


def placement_ratios(loads: list[torch.Tensor], ep: int, redundant: int | None, every: int) -> list[float]:
    """Per step, the busiest rank's rows over the mean: contiguous (``redundant=None``), or EPLB's placement
    re-computed every ``every`` steps from the previous ``every`` steps' loads."""
    blocks, experts = loads[0].shape
    placement = ExpertPlacement.contiguous(blocks, experts, ep)
    ratios = []
    for step, step_loads in enumerate(loads):
        if redundant is not None and step and step % every == 0:
            placement = balance_experts(torch.stack(loads[step - every : step]).sum(0), ep, redundant)
        ratios.append(placement.max_over_mean(step_loads))
    return ratios


def summarise(method: str, loads: list[torch.Tensor], ep: int, every: int) -> list[dict[str, Any]]:
    rows = []
    for name, redundant in (("contiguous", None), ("eplb_r0", 0), (f"eplb_r{ep}", ep)):
        ratios = placement_ratios(loads, ep, redundant, every)
        served = ratios[every:]  # the steps a placement served (contiguous: the same steps)
        half = len(served) // 2
        rows.append(
            {
                "method": method,
                "ep": ep,
                "placement": name,
                "redundant_slots": redundant or 0,
                "slots_per_rank": (loads[0].shape[1] + (redundant or 0)) // ep,
                "mean_max_over_mean": statistics.mean(served),
                "first_half": statistics.mean(served[:half]) if half else None,
                "second_half": statistics.mean(served[half:]),
                "worst_step": max(served),
            }
        )
    return rows


def measure(steps: int, seq_len: int, micro_batch: int, every: int, eps: tuple[int, ...]) -> dict[str, Any]:
    rows = []
    for method, moe in METHODS.items():
        run = run_workers(balance_worker, 1, moe, steps, seq_len, micro_batch, timeout_s=900)[0]
        loads = [torch.tensor(step) for step in run["loads"]]
        for ep in eps:
            rows += summarise(method, loads, ep, every)
    return {"steps": steps, "seq_len": seq_len, "micro_batch": micro_batch, "every": every, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nBusiest rank's rows over the mean, steps {result['every']}-{result['steps'] - 1} (re-placed every "
          f"{result['every']} steps from the steps before; lower is better, 1.0 even)")  # fmt: skip
    print(f"{'method':<14} {'ep':>3} {'placement':<11} {'slots/rank':>10} {'mean':>6} {'1st half':>8} "
          f"{'2nd half':>8} {'worst':>6}")  # fmt: skip
    for r in result["rows"]:
        first = "-" if r["first_half"] is None else f"{r['first_half']:.3f}"
        mean, second, worst = r["mean_max_over_mean"], r["second_half"], r["worst_step"]
        print(f"{r['method']:<14} {r['ep']:>3} {r['placement']:<11} {r['slots_per_rank']:>10} "
              f"{mean:>6.3f} {first:>8} {second:>8.3f} {worst:>6.3f}")  # fmt: skip
    print("step time under a placement: not measured (experts are not moved during training yet)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps, ep=2 (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, seq_len, micro_batch, every = (6, 16, 4, 2) if args.quick else (400, 64, 32, EVERY)
    eps = (2,) if args.quick else (2, 4)
    result = measure(steps, seq_len, micro_batch, every, eps)
    print_table(result)
    payload = {
        "benchmark": "expert_placement",
        "quick": args.quick,
        "device": "CPU, one process (routing is layout-independent)",
        "torch": torch.__version__,
        "step_time": "not measured",
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
