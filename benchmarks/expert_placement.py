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

Then the same skew trained under expert parallelism itself, on ep forked gloo processes (ep = 2 and 4),
``ExpertParallel(ep)`` against ``ExpertParallel(ep, redundant_experts=ep, rebalance_every=EVERY)``
(the aux-loss-free bias on, as ``moe_tiny`` trains): the rows each rank's experts actually received
(``AllToAllDispatcher.received``), per step, as the busiest rank over the mean (averaged over the MoE
blocks), before the first re-placement and after it; and tokens/s side by side in alternated rounds, the
median of the paired ratios with a 95% bootstrap interval (``testing.timing.Alternation``). Two CPU
cores: at ep 4 four processes share them, and this model's experts (dim 64, width 64) are a small part of
a step next to gloo's latency and the bookkeeping, while a placement adds an all-to-all of the experts'
weights each forward and of their gradients each backward: these timings say nothing of GPUs, where the
experts' GEMMs are the step. The planner prices the balance as ``Workload.expert_load``
(``plan.expert_load(loads, ep, redundant=R)``) and the placement's weight traffic.

    python benchmarks/expert_placement.py            # ~8 minutes on 2 CPU cores
    python benchmarks/expert_placement.py --quick    # a smoke run for the test suite
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from expert import ADAMW, MODEL, MOE, balance_worker, skew_router

from lightning_ultrascale import ExpertParallel, LlamaModule, UltraScaleStrategy
from lightning_ultrascale.parallel.expert.placement import ExpertPlacement, balance_experts
from lightning_ultrascale.testing.spawn import run_workers
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s

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


# ----------------------------------------------------------------------------- under expert parallelism
class SkewedRows(L.Callback):
    """The skew before the first step; after each step the rows this rank's experts (slots) received, per block."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []  # [step][MoE block]: this rank's rows

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, LlamaModule) and pl_module.model is not None
        skew_router(pl_module.model)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        assert isinstance(pl_module, LlamaModule) and pl_module.model is not None
        step = []
        for moe in pl_module.model.moe_layers().values():
            step.append(float(moe.dispatcher.received.sum()))
            moe.dispatcher.received = None
        self.rows.append(step)


def _plugin(ep: int, placed: bool, every: int) -> ExpertParallel:
    return ExpertParallel(ep, redundant_experts=ep, rebalance_every=every) if placed else ExpertParallel(ep)


def rows_worker(ep: int, placed: bool, every: int, steps: int, seq_len: int, micro_batch: int) -> list[list[float]]:
    record = SkewedRows()
    strategy = UltraScaleStrategy(_plugin(ep, placed, every))
    fit_tokens_per_s(LlamaModule(MODEL, optim=ADAMW), strategy, devices=ep, steps=steps, seq_len=seq_len,
                     micro_batch=micro_batch, data_ranks=ep, callbacks=[record])  # fmt: skip
    return record.rows


def speed_worker(ep: int, placed: bool, every: int, steps: int, seq_len: int, micro_batch: int) -> float:
    return fit_tokens_per_s(LlamaModule(MODEL, optim=ADAMW), UltraScaleStrategy(_plugin(ep, placed, every)),
                            devices=ep, steps=steps, seq_len=seq_len, micro_batch=micro_batch, data_ranks=ep,
                            callbacks=[SkewedRows()])  # fmt: skip


def measure_runtime(ep: int, every: int, steps: int, seq_len: int, micro_batch: int, rounds: dict[str, Any]) -> dict:
    """Rows per rank (each arm once) and tokens/s in alternated rounds, contiguous against placed, at ``ep``."""
    row: dict[str, Any] = {"ep": ep, "redundant_slots": ep, "every": every, "steps": steps}
    for name, placed in (("contiguous", False), ("placed", True)):
        ranks = run_workers(rows_worker, ep, ep, placed, every, steps, seq_len, micro_batch, timeout_s=900)
        per_step = torch.tensor(ranks).permute(1, 2, 0)  # [step, block, rank]
        ratio = (per_step.max(-1).values / per_step.mean(-1)).mean(-1)  # per step, averaged over the blocks
        row[f"{name}_before"] = float(ratio[:every].mean())
        row[f"{name}_after"] = float(ratio[every:].mean())

    def arm(placed: bool) -> Callable[[], float]:
        return lambda: run_workers(speed_worker, ep, ep, placed, every, steps, seq_len, micro_batch, timeout_s=900)[0]

    arms = {"contiguous": arm(False), "placed": arm(True)}
    alternation = Alternation(arms, baseline="contiguous", **rounds)
    paired = alternation.run()["placed"]
    row["tokens_per_s"] = {name: statistics.median(v) for name, v in alternation.samples.items()}
    row["placed_over_contiguous"] = paired.median
    row["paired_ratio"] = paired.as_dict()
    return row


def print_runtime(rows: list[dict[str, Any]]) -> None:
    print("\nUnder expert parallelism (the skew, the aux-loss-free bias on): busiest rank's rows / mean, as received")
    print(f"{'ep':>3} {'contiguous before/after':>24} {'placed before/after':>20} {'tokens/s contiguous':>20} "
          f"{'placed':>8} {'placed / contiguous [95% CI]':>30}")  # fmt: skip
    for r in rows:
        low, high = r["paired_ratio"]["ci_low"], r["paired_ratio"]["ci_high"]
        ci = {"low": math.nan if low is None else low, "high": math.nan if high is None else high}
        print(f"{r['ep']:>3} {r['contiguous_before']:>11.3f} / {r['contiguous_after']:<10.3f} "
              f"{r['placed_before']:>8.3f} / {r['placed_after']:<9.3f} {r['tokens_per_s']['contiguous']:>20.0f} "
              f"{r['tokens_per_s']['placed']:>8.0f} {r['placed_over_contiguous']:>10.3f} "
              f"[{ci['low']:.3f}, {ci['high']:.3f}]")  # fmt: skip


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps, ep=2 (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, seq_len, micro_batch, every = (6, 16, 4, 2) if args.quick else (400, 64, 32, EVERY)
    eps = (2,) if args.quick else (2, 4)
    result = measure(steps, seq_len, micro_batch, every, eps)
    run_steps, run_seq, run_batch = (4, 16, 2) if args.quick else (3 * EVERY, 128, 8)
    rounds = (
        {"min_rounds": 1, "max_rounds": 1} if args.quick else {"min_rounds": 6, "max_rounds": 20, "max_seconds": 200}
    )
    runtime = [measure_runtime(ep, every, run_steps, run_seq, run_batch, rounds) for ep in eps]
    print_table(result)
    print_runtime(runtime)
    payload = {
        "benchmark": "expert_placement",
        "quick": args.quick,
        "device": "CPU: one process for the loads (routing is layout-independent); ep gloo processes for the runs",
        "torch": torch.__version__,
        **result,
        "runtime": runtime,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
