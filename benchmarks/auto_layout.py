"""``parallel=auto`` against the clock: the planner's top 3 layouts for the default job, each timed.

The default training job (``ultrascale-train``: llama_tiny, seq 256, global batch 16, 2 CPU
processes) with ``parallel=auto``: the planner searches its layouts on the built-in ``cpu``
profile; this trains each of its three best in the real Lightning loop and measures the median
step time (after two warm-up steps). The chosen layout must be within 10% of the fastest measured.
Prints a table and writes ``benchmarks/results/auto_layout.json``.

    python benchmarks/auto_layout.py            # ~1 min on 2 cores
    python benchmarks/auto_layout.py --quick    # a smoke run for the test suite: the top layout, 4 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule
from lightning_ultrascale.cli.plan import compose_run
from lightning_ultrascale.cli.train import workload
from lightning_ultrascale.plan import Candidate, search
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER

sys.path.insert(0, str(Path(__file__).parent))
from cpu_time_model import StepClock

RESULTS = Path(__file__).parent / "results" / "auto_layout.json"
STEPS, WARMUP = 10, 2


def run_worker(candidate: Candidate, global_batch: int, seq_len: int, steps: int = STEPS) -> float:
    clock = StepClock()
    accumulation = global_batch // (candidate.batch_per_rank * candidate.dp)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=candidate.strategy(), max_steps=steps,
                        accumulate_grad_batches=accumulation, callbacks=[clock], **QUIET_TRAINER)  # fmt: skip
    module = LlamaModule("llama_tiny", optim=OptimConfig(name="adamw", lr=1e-4, warmup_steps=0))
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=candidate.batch_per_rank))
    return statistics.median(b - a for a, b in zip(clock.stamps[WARMUP:], clock.stamps[WARMUP + 1 :]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the top layout only, 4 steps (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = compose_run(["parallel=auto"])
    work = workload(cfg)
    result = search(work, 2, "cpu")
    top, steps = (result.fitting[:1], WARMUP + 2) if args.quick else (result.fitting[:3], STEPS)
    rows: list[dict[str, Any]] = []
    print(f"{'rank':<5} {'layout':<50} {'predicted s':>11} {'measured s':>10}")
    for i, priced in enumerate(top):
        measured = max(
            run_workers(run_worker, 2, priced.candidate, work.global_batch_size, work.seq_len, steps, timeout_s=600)
        )
        rows.append({"rank": i + 1, "layout": priced.candidate.label(), "predicted_s": priced.step_time,
                     "measured_s": measured})  # fmt: skip
        print(f"{i + 1:<5} {rows[-1]['layout']:<50} {priced.step_time:>11.3f} {measured:>10.3f}")
    fastest = min(r["measured_s"] for r in rows)
    chosen = rows[0]["measured_s"] / fastest - 1
    print(f"\nthe chosen layout is {chosen:.1%} slower than the fastest of the three measured")
    payload = {"benchmark": "auto_layout", "job": "ultrascale-train parallel=auto", "rows": rows,
               "chosen_over_fastest": chosen}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
