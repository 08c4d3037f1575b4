"""Data parallelism: gradient traffic vs the ring all-reduce formula, and speed vs Lightning's ``ddp``.

Prints two tables and writes ``benchmarks/results/dp.json``:

1. Communication per optimizer step, traced (``CommTracer``) around backward on every rank: the
   bytes handed to all-reduce over the ``dp_cp`` dim (must be Ψ, the gradient bytes) and the
   per-rank ring traffic 2Ψ(N-1)/N that this implies, against the playbook's formula.
2. Tokens/s of ``UltraScaleStrategy(DataParallel())`` and Lightning's built-in ``ddp`` on the same
   model, data and process count, as alternated pairs (``testing.timing.Alternation``: these
   machines are noisy, only a ratio measured side by side means anything): the median of the paired
   ratios with its 95% bootstrap interval, pairs added until the interval is within ±1.5% or the
   time budget is spent; the table says when the interval straddles 1.0.

    python benchmarks/dp.py            # full run (~3 minutes on 2 CPU cores)
    python benchmarks/dp.py --quick    # a smoke run for the test suite: N=2 only, 4 steps (figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

from lightning_ultrascale import DataParallel, LlamaModule, UltraScaleDataModule, UltraScaleStrategy  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s  # noqa: E402
from lightning_ultrascale.utils.comm import CommTracer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "dp.json"


class TraceBackward(L.Callback):
    """Trace the collectives of each backward pass (where DP reduces gradients)."""

    def __init__(self) -> None:
        self.tracer: CommTracer | None = None
        self.per_step: list[dict[str, int]] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.tracer = CommTracer(trainer.strategy.mesh.root)
        self.tracer.__enter__()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.tracer is not None
        self.tracer.__exit__(None, None, None)
        self.per_step.append(
            {
                "calls": sum(r.op == "all_reduce" for r in self.tracer.records),
                "payload": self.tracer.total(op="all_reduce", kind="payload"),
                "wire": self.tracer.total(op="all_reduce", kind="wire"),
                "dims": sorted({r.dim for r in self.tracer.records}),
            }
        )


def _trainer(strategy: Any, world_size: int, steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        **QUIET_TRAINER,
    )


def comm_worker(world_size: int, seq_len: int, micro_batch: int) -> dict[str, Any]:
    tracer = TraceBackward()
    module = LlamaModule("llama_tiny")
    trainer = _trainer(UltraScaleStrategy(DataParallel()), world_size, 2, [tracer])
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro_batch))
    n_params = sum(p.numel() for p in module.parameters())
    return {"n_params": n_params, "param_bytes": n_params * 4, "steps": tracer.per_step}


def speed_worker(kind: str, world_size: int, steps: int, seq_len: int, micro_batch: int) -> float:
    strategy: Any = UltraScaleStrategy(DataParallel()) if kind == "ultrascale" else "ddp"
    return fit_tokens_per_s(LlamaModule("llama_tiny"), strategy, devices=world_size, steps=steps, seq_len=seq_len,
                            micro_batch=micro_batch, data_ranks=world_size)  # fmt: skip


def _measure(kind: str, world: int, steps: int, seq_len: int, micro_batch: int) -> float:
    return run_workers(speed_worker, world, kind, world, steps, seq_len, micro_batch, timeout_s=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N=2 only, 4 steps, one repeat (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seq_len, micro_batch = (32, 2) if args.quick else (256, 8)
    steps = 4 if args.quick else 20
    rounds = (
        {"min_rounds": 1, "max_rounds": 1} if args.quick else {"min_rounds": 8, "max_rounds": 40, "max_seconds": 540}
    )

    comm_rows = []
    for n in (2,) if args.quick else (2, 4):
        r = run_workers(comm_worker, n, n, seq_len, micro_batch, timeout_s=300)[0]
        step = r["steps"][-1]
        formula = 2 * r["param_bytes"] * (n - 1) / n
        comm_rows.append(
            {
                "N": n,
                "params": r["n_params"],
                "grad_bytes": r["param_bytes"],
                "all_reduce_calls": step["calls"],
                "all_reduce_payload_bytes": step["payload"],
                "wire_bytes_per_rank": step["wire"],
                "formula_2psi_(n-1)/n": formula,
                "ratio": step["wire"] / formula,
                "dims": step["dims"],
            }
        )

    world = 2
    arms = {kind: partial(_measure, kind, world, steps, seq_len, micro_batch) for kind in ("ddp", "ultrascale")}
    alternation = Alternation(arms, baseline="ddp", **rounds)
    ratio = alternation.run()["ultrascale"]
    ours, theirs = (statistics.median(alternation.samples[k]) for k in ("ultrascale", "ddp"))
    speed = {
        "world_size": world,
        "tokens_per_step": world * micro_batch * seq_len,
        "steps_per_run": steps,
        "ultrascale_tokens_per_s": ours,
        "ddp_tokens_per_s": theirs,
        "ratio_ultrascale_over_ddp": ratio.median,
        "paired_ratio": ratio.as_dict(),
        "samples": alternation.samples,
    }

    print("Gradient all-reduce per optimizer step (fp32, llama_tiny), traced on rank 0")
    print(f"{'N':>2} {'params':>9} {'calls':>5} {'payload B':>10} {'wire B/rank':>12} {'2Ψ(N-1)/N':>12} {'ratio':>7}")
    for c in comm_rows:
        print(
            f"{c['N']:>2} {c['params']:>9,} {c['all_reduce_calls']:>5} {c['all_reduce_payload_bytes']:>10,} "
            f"{c['wire_bytes_per_rank']:>12,.0f} {c['formula_2psi_(n-1)/n']:>12,.0f} {c['ratio']:>7.4f}"
        )
    print(f"\nTokens/s, {world} CPU processes, {len(ratio.ratios)} alternated pairs of runs of {steps} steps (medians)")
    print(f"{'strategy':<24} {'tokens/s':>10}")
    print(f"{'UltraScaleStrategy (DP)':<24} {ours:>10,.0f}")
    print(f"{'Lightning ddp':<24} {theirs:>10,.0f}")
    print(ratio.describe())

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "dp", "quick": args.quick, "device": "cpu", "comm": comm_rows, "speed": speed}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
